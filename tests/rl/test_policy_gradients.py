"""Policy gradients are correct (not bitwise): close to a plain-torch reference's.

Reference: the `transformers` model the tiny random model was saved from (fp32, ordinary autograd).
Loss: the sum of the logprobs of every token but the first of a few sequences, weighted per token so
that no gradient is a plain sum. Tolerances, relative in the L2 norm per parameter tensor:
  - fp32 policy: 1e-4 (measured at most 1.3e-6 on llama, qwen2, qwen3: only summation orders differ);
  - bf16 policy (bf16 weights and activations against the fp32 reference): 5e-2 (measured at most
    1.6e-2, median 1e-2: bf16 rounding).
The default model (slow): every parameter's gradient is finite and the total is non-zero.
"""

from __future__ import annotations

import pytest
import torch

from deterministic_inference.config import EngineConfig
from deterministic_inference.rl import Policy
from tests.tiny_models import TinyModel

SEQUENCES = [[5, 17, 42, 99, 7, 250, 31], [12, 8, 8, 140, 201, 3, 66, 77, 88, 9, 10], [1, 2, 3]]
TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}


def weights_for(sequence: list[int]) -> torch.Tensor:
    """Per-token loss weights [len - 1] (fixed, distinct, some negative: like advantages)."""
    return torch.linspace(-1.0, 2.0, len(sequence) - 1)


def policy_gradients(tiny: TinyModel, dtype: str) -> dict[str, torch.Tensor]:
    config = EngineConfig(model=str(tiny.path), dtype=dtype, quantization="none")
    policy = Policy.from_config(config)
    values = policy.score(SEQUENCES)
    loss = sum((v * weights_for(s)).sum() for v, s in zip(values, SEQUENCES, strict=True))
    assert isinstance(loss, torch.Tensor)
    loss.backward()
    return {name: p.grad.clone() for name, p in policy.named_parameters() if p.grad is not None}


def reference_gradients(tiny: TinyModel) -> dict[str, torch.Tensor]:
    model = tiny.model
    model.zero_grad()
    total = torch.zeros(())
    for sequence in SEQUENCES:
        ids = torch.tensor([sequence])
        logprobs = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)  # [L - 1, V]
        picked = logprobs.gather(1, ids[0, 1:, None]).squeeze(1)
        total = total + (picked * weights_for(sequence)).sum()
    total.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    if model.config.tie_word_embeddings:
        grads.pop("lm_head.weight", None)  # the same tensor as the embedding
    return grads


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("architecture", ["llama", "qwen2", "qwen3"])
def test_gradients_match_the_plain_torch_reference(
    architecture: str, dtype: str, request: pytest.FixtureRequest
) -> None:
    tiny: TinyModel = request.getfixturevalue(f"tiny_{architecture}_dir")
    found = policy_gradients(tiny, dtype)
    expected = reference_gradients(tiny)
    assert set(found) == set(expected)
    for name, reference in expected.items():
        error = float((found[name] - reference).norm() / reference.norm())
        assert error < TOLERANCE[dtype], f"{name}: relative error {error:.2e}"


@pytest.mark.slow
def test_default_model_gradients_are_finite_and_non_zero() -> None:
    policy = Policy.from_config(EngineConfig(quantization="none"))
    values = policy.score([[1, 504, 3458, 314, 4649, 28, 260, 2], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]])
    torch.cat(values).sum().backward()
    total = 0.0
    for name, parameter in policy.named_parameters():
        assert parameter.grad is not None, name
        assert bool(torch.isfinite(parameter.grad).all()), name
        total += float(parameter.grad.abs().sum())
        assert float(parameter.grad.abs().max()) > 0.0, f"{name}: zero gradient"
    assert total > 0.0
