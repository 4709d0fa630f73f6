"""`ops.logprobs.log_softmax_rows`, the one logprob function of the sampler and the RL policy.

A row's bits do not depend on the other rows, their number or the row's position (raw float32 bits), and
every sampler path (greedy batch, seeded batch, per row, prompt logprobs) reports exactly its values.
"""

from __future__ import annotations

import pytest
import torch

from deterministic_inference.engine import sampler
from deterministic_inference.engine.sampling_params import SamplingParams
from deterministic_inference.ops.logprobs import log_softmax_rows


def bits(x: torch.Tensor) -> list[int]:
    return x.contiguous().view(torch.int32).flatten().tolist()


def test_rows_do_not_depend_on_their_neighbours() -> None:
    logits = torch.randn(24, 1000, generator=torch.Generator().manual_seed(0)) * 4.0
    batched = log_softmax_rows(logits)
    for row in range(logits.shape[0]):
        assert bits(log_softmax_rows(logits[row : row + 1])) == bits(batched[row])
        assert bits(log_softmax_rows(logits[row:])[0]) == bits(batched[row])
    assert batched.dtype == torch.float32
    assert bits(log_softmax_rows(logits.to(torch.bfloat16))) == bits(
        log_softmax_rows(logits.to(torch.bfloat16).float())
    )


def test_every_sampler_path_reports_these_values() -> None:
    logits = torch.randn(6, 500, generator=torch.Generator().manual_seed(1)) * 3.0
    expected = log_softmax_rows(logits)
    params = [
        SamplingParams(temperature=0.0),  # greedy batch
        SamplingParams(temperature=1.0, seed=3),  # seeded batch
        SamplingParams(temperature=0.7, top_p=0.9, seed=4),
        SamplingParams(temperature=1.0, min_p=0.1, seed=5),  # per-row path
        SamplingParams(temperature=1.0, repetition_penalty=1.3, seed=6),  # per-row path (penalty)
        SamplingParams(temperature=0.0, presence_penalty=0.5),
    ]
    past = [[1, 2, 3]] * 6
    result = sampler.sample(logits, params, [0] * 6, [2] * 6, past, [[3]] * 6)
    for row, (token, value) in enumerate(zip(result.token_ids, result.logprobs, strict=True)):
        assert bits(torch.tensor([value], dtype=torch.float32)) == bits(expected[row, token : token + 1])
    prompt_values, _ = sampler.prompt_logprobs(logits, [7] * 6, 0)
    assert bits(torch.tensor(prompt_values, dtype=torch.float32)) == bits(expected[:, 7])


def test_rejects_anything_but_rows() -> None:
    with pytest.raises(ValueError, match="rows, vocab"):
        log_softmax_rows(torch.zeros(5))
