"""Grammar masks in the sampler: every path (batched greedy, batched seeded, per-row) gives a masked row
the bits of the per-row reference, picks only allowed tokens, and returns the raw (unmasked) logprobs.

Bitwise: tokens exactly, logprobs and top logprobs as raw float32 bits. Negative control: the same
comparison sees a row whose mask was swapped with another row's.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from deterministic_inference.engine import sampler
from deterministic_inference.engine.sampling_params import SamplingParams
from tests.engine.test_sampler_seeded_batched import make_logits, result_rows, row_bits

PARAMS = {
    "greedy": SamplingParams(temperature=0.0),
    "greedy-top3": SamplingParams(temperature=0.0, logprobs=3),
    "seeded": SamplingParams(temperature=1.0),
    "seeded-top-p": SamplingParams(temperature=0.8, top_p=0.9, logprobs=2),
    "seeded-top-k-p": SamplingParams(temperature=1.3, top_k=50, top_p=0.5),
    "min-p": SamplingParams(temperature=0.7, min_p=0.1),
    "penalties": SamplingParams(temperature=0.9, repetition_penalty=1.2, frequency_penalty=0.3),
}


def make_masks(rows: int, vocab: int, seed: int) -> list[torch.Tensor | None]:
    """Every other row constrained; masks allow 1, a few or many tokens."""
    gen = torch.Generator().manual_seed(seed)
    masks: list[torch.Tensor | None] = []
    for r in range(rows):
        if r % 2:
            masks.append(None)
            continue
        density = [0.0005, 0.01, 0.5][(r // 2) % 3]
        allowed = torch.rand(vocab, generator=gen) < density
        allowed[(r * 7919) % vocab] = True
        masks.append(allowed)
    return masks


def sample_all(
    logits: torch.Tensor, params: list[SamplingParams], masks: list[torch.Tensor | None], first: int = 0
) -> list:
    """Rows sampled together; row r has seed 100 + first + r and position 3 + first + r."""
    rows = logits.shape[0]
    past = [[1, 2, 5] for _ in range(rows)]
    result = sampler.sample(
        logits,
        params,
        [100 + first + r for r in range(rows)],
        [3 + first + r for r in range(rows)],
        past,
        [[2, 5]] * rows,
        masks,
    )
    return result_rows(result)


def reference(logits: torch.Tensor, params: list[SamplingParams], masks: list[torch.Tensor | None]) -> list:
    return [
        row_bits(sampler._sample_row(logits[r], params[r], 100 + r, 3 + r, [1, 2, 5], [2, 5], masks[r]))
        for r in range(logits.shape[0])
    ]


@pytest.mark.parametrize(("name", "vocab"), itertools.product(sorted(PARAMS), [300, 49152]))
def test_masked_rows_match_the_per_row_reference_on_every_path(name: str, vocab: int) -> None:
    rows = 12
    logits = make_logits(rows, vocab, seed=vocab + len(name))
    params = [PARAMS[name]] * rows
    masks = make_masks(rows, vocab, seed=3)
    batched = sample_all(logits, params, masks)
    assert batched == reference(logits, params, masks)
    unmasked_logprobs = sample_all(logits, params, [None] * rows)
    for r, mask in enumerate(masks):
        if mask is not None:
            assert mask[batched[r][0]], f"row {r} picked a disallowed token"
            raw = sampler._row_logprobs(logits[r].to(torch.float32))
            assert batched[r][1][0] == raw[batched[r][0]].view(torch.int32).item()  # raw logprob
            assert batched[r][1][1:] == unmasked_logprobs[r][1][1:]  # top logprobs: the raw row's
        else:
            assert batched[r] == unmasked_logprobs[r]  # unconstrained neighbours are untouched


def test_a_row_alone_equals_the_row_in_a_mixed_batch() -> None:
    vocab, rows = 2000, 9
    logits = make_logits(rows, vocab, seed=1)
    params = [list(PARAMS.values())[r % len(PARAMS)] for r in range(rows)]
    masks = make_masks(rows, vocab, seed=5)
    batched = sample_all(logits, params, masks)
    for r in range(rows):
        assert sample_all(logits[r : r + 1], params[r : r + 1], masks[r : r + 1], first=r)[0] == batched[r]


def test_negative_control_a_swapped_mask_is_seen() -> None:
    vocab, rows = 2000, 6
    logits = make_logits(rows, vocab, seed=2)
    params = [PARAMS["seeded"]] * rows
    masks = make_masks(rows, vocab, seed=8)
    swapped = list(masks)
    swapped[0], swapped[2] = masks[2], masks[0]
    assert sample_all(logits, params, swapped) != reference(logits, params, masks)
