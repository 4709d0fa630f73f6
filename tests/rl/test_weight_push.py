"""The RL loop keeps parity: after an optimizer step and a weight push (in process), the engine's next
sampled logprobs equal the policy's bit for bit, and differ from the pre-update ones; the fingerprint
changes with the weights. Tiny random Llama, bf16 (the default dtype on CPUs with native bf16).
"""

from __future__ import annotations

import torch

from deterministic_inference.config import EngineConfig
from deterministic_inference.engine.engine import Engine
from deterministic_inference.rl import Policy
from tests.rl.helpers import Sampled, bits, mixed_prompts, sample
from tests.tiny_models import TinyModel


def score(policy: Policy, samples: list[Sampled]) -> list[torch.Tensor]:
    return policy.completion_logprobs([s.prompt for s in samples], [s.completion for s in samples])


def test_parity_survives_optimizer_steps_and_weight_pushes(tiny_llama_dir: TinyModel) -> None:
    path = str(tiny_llama_dir.path)
    settings = {"dtype": "bfloat16", "quantization": "none", "num_kv_blocks": 128, "selfcheck": False}
    config = EngineConfig(model=path, **settings)  # type: ignore[arg-type]
    engine = Engine(config)
    policy = Policy.for_engine(engine)
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-2)
    prompts = mixed_prompts(4, engine.spec.vocab_size, seed=3)
    fingerprints = [engine.system_fingerprint]
    before: list[Sampled] | None = None
    for _ in range(2):
        samples = sample(engine, prompts, first_seed=0)
        values = score(policy, samples)
        for s, value in zip(samples, values, strict=True):
            assert bits(value) == bits(s.logprobs)  # importance ratio exactly 1
        if before is not None:  # same prompts and seeds, new weights: other logprobs
            assert any(bits(a.logprobs) != bits(b.logprobs) for a, b in zip(before, samples, strict=True))
        before = samples
        loss = -sum(v.sum() for v in values)
        assert isinstance(loss, torch.Tensor)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        fingerprints.append(engine.update_weights(policy.engine_weights()))
    assert len(set(fingerprints)) == len(fingerprints)
    assert engine.kv.num_cached_blocks == 0  # flushed by the last push
