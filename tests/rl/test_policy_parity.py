"""Trainer logprobs == sampler logprobs, bit for bit (tiny random Llama; bf16 and fp32).

The engine samples seeded T=1.0 completions of 16 mixed prompts in batches of 1, 2, 5 and 8, then all 16
again in one batch (other seeds), with chunked
prefill (a 24-token step budget splits the longer prompts) and prefix-cache hits (a shared 33-token
prefix warmed first). The policy then scores the same sequences grouped and padded differently: all at
once, one at a time, in reversed groups of 3, and as left- and right-padded [B, L] batches. Every logprob
must have the engine's float32 bits.

Negative control: the same policy on plain torch ops (`invariant=False`) differs in at least one bit.
"""

from __future__ import annotations

import pytest
import torch

from deterministic_inference.config import EngineConfig
from deterministic_inference.engine.engine import Engine
from deterministic_inference.rl import Policy
from tests.rl.helpers import Sampled, bits, mixed_prompts, sample
from tests.tiny_models import TinyModel

GROUPS = (1, 2, 5, 8)  # batch sizes the engine samples in (16 prompts)


def engine_config(tiny: TinyModel, dtype: str) -> EngineConfig:
    return EngineConfig(
        model=str(tiny.path), dtype=dtype, quantization="none", max_num_batched_tokens=24,
        num_kv_blocks=256, selfcheck=False,
    )  # fmt: skip


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def sampled(request: pytest.FixtureRequest, tiny_llama_dir: TinyModel) -> tuple[Engine, list[Sampled]]:
    engine = Engine(engine_config(tiny_llama_dir, request.param))
    prompts = mixed_prompts(16, engine.spec.vocab_size)
    sample(engine, [prompts[0][:33]], first_seed=100)  # warm the shared prefix
    results: list[Sampled] = []
    for size in GROUPS:
        start = len(results)
        results.extend(sample(engine, prompts[start : start + size], first_seed=start))
    results.extend(sample(engine, prompts, first_seed=len(prompts)))  # a batch of 16
    return engine, results


def padded(samples: list[Sampled], left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, L] input ids and attention mask of prompt + completion rows, padded with token 0."""
    rows = [s.prompt + s.completion for s in samples]
    width = max(len(row) for row in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.int64)
    mask = torch.zeros((len(rows), width), dtype=torch.int64)
    for index, row in enumerate(rows):
        columns = slice(width - len(row), width) if left else slice(0, len(row))
        ids[index, columns] = torch.tensor(row)
        mask[index, columns] = 1
    return ids, mask


def groupings(policy: Policy, samples: list[Sampled]) -> dict[str, list[torch.Tensor]]:
    """The completions' logprobs as the policy scores them in several groupings and paddings."""

    def score(group: list[Sampled]) -> list[torch.Tensor]:
        return policy.completion_logprobs([s.prompt for s in group], [s.completion for s in group])

    found: dict[str, list[torch.Tensor]] = {"all at once": score(samples)}
    found["one at a time"] = [score([s])[0] for s in samples]
    reversed_groups: list[torch.Tensor] = []
    for start in range(0, len(samples), 3):
        reversed_groups.extend(reversed(score(list(reversed(samples[start : start + 3])))))
    found["reversed groups of 3"] = reversed_groups
    for left in (False, True):
        rows: list[torch.Tensor] = []
        for start in range(0, len(samples), 5):
            group = samples[start : start + 5]
            ids, mask = padded(group, left)
            table = policy(ids, mask)  # [B, L]
            for index, s in enumerate(group):
                end = int(mask[index].nonzero().max()) + 1
                rows.append(table[index, end - len(s.completion) : end])
        found["left-padded" if left else "right-padded"] = rows
    return found


def test_policy_logprobs_equal_the_sampled_logprobs_bitwise(sampled: tuple[Engine, list[Sampled]]) -> None:
    engine, samples = sampled
    assert any(s.cached_tokens > 0 for s in samples), "no prefix-cache hit happened"
    assert any(len(s.prompt) > 24 for s in samples), "no prompt was chunked"
    with torch.no_grad():
        found = groupings(Policy.for_engine(engine), samples)
    for name, values in found.items():
        for index, (s, value) in enumerate(zip(samples, values, strict=True)):
            assert bits(value) == bits(s.logprobs), f"{name}: sequence {index} differs"


def test_plain_torch_policy_differs(sampled: tuple[Engine, list[Sampled]]) -> None:
    """Negative control: without the engine's kernels the same scoring misses some bits."""
    engine, samples = sampled
    with torch.no_grad():
        plain = Policy.for_engine(engine, invariant=False)
        values = plain.completion_logprobs([s.prompt for s in samples], [s.completion for s in samples])
    differing = sum(bits(v) != bits(s.logprobs) for s, v in zip(samples, values, strict=True))
    assert differing > 0
    for s, value in zip(samples, values, strict=True):  # ... while computing the same model
        assert torch.allclose(value, s.logprobs, atol=5e-2)


@pytest.mark.slow
def test_default_model_parity() -> None:
    """The default model (SmolLM2-135M, --quantization none, the engine's dtype): chunked prefill of
    mixed prompts in one batch and alone, scored by the policy all at once and one at a time."""
    engine = Engine(
        EngineConfig(quantization="none", max_num_batched_tokens=32, num_kv_blocks=64, selfcheck=False)
    )
    texts = ["The capital of France is", "Write a haiku about rivers and the sea, please. " * 5, "1, 2, 3,"]
    prompts = [engine.encode_prompt(text) for text in texts]
    assert len(prompts[1]) > 32  # chunked
    samples = sample(engine, prompts, first_seed=0, max_tokens=12) + sample(engine, prompts[1:2], 9)
    policy = Policy.for_engine(engine)
    with torch.no_grad():
        together = policy.completion_logprobs([s.prompt for s in samples], [s.completion for s in samples])
        alone = [policy.completion_logprobs([s.prompt], [s.completion])[0] for s in reversed(samples)]
    for s, a, b in zip(samples, together, reversed(alone), strict=True):
        assert bits(a) == bits(s.logprobs) == bits(b)
