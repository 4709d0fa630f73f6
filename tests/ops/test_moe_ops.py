"""The compiled MoE routing and expert sum (ops/csrc/moe.c): the documented operations, bit for bit, ties
to the lower expert index, and per-token results that do not depend on the other tokens of the call."""

from __future__ import annotations

import pytest
import torch

from deterministic_inference.ops.moe import combine_native, route_native, route_torch
from deterministic_inference.ops.native import native_kernels
from deterministic_inference.ops.probes import raw_bits


def test_ties_go_to_the_lower_expert_index_and_ids_ascend() -> None:
    kernels = native_kernels()
    nan = float("nan")
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.5, 3.0], [2.0, 2.0, 2.0, 2.0, 2.0], [0.0, nan, 1.0, -1.0, 5.0]])
    ids, weights = route_native(kernels, logits, 2, normalize=True)
    assert ids.tolist() == [[1, 2], [0, 1], [2, 4]]  # NaN ranks below every number
    assert weights[0].tolist() == [0.5, 0.5] and weights[1].tolist() == [0.5, 0.5]
    three, _ = route_native(kernels, logits, 3, normalize=False)
    assert three.tolist() == [[1, 2, 4], [0, 1, 2], [0, 2, 4]]


@pytest.mark.parametrize("normalize", [True, False])
def test_weights_are_the_softmax_over_the_chosen_or_all_experts(normalize: bool) -> None:
    logits = torch.randn(50, 16, generator=torch.Generator().manual_seed(0)) * 3
    ids, weights = route_native(native_kernels(), logits, 4, normalize)
    probs = torch.softmax(logits.double(), dim=-1)
    top = probs.gather(1, ids)
    expected = top / top.sum(dim=1, keepdim=True) if normalize else top
    torch.testing.assert_close(weights.double(), expected, rtol=1e-6, atol=1e-7)
    torch_ids, torch_weights = route_torch(logits, 4, normalize)  # transformers' formulation, same choice
    assert torch.equal(torch_ids, ids)
    torch.testing.assert_close(torch_weights, weights, rtol=1e-6, atol=1e-7)


def test_a_tokens_route_does_not_depend_on_the_other_tokens() -> None:
    generator = torch.Generator().manual_seed(1)
    logits = torch.round(4 * torch.randn(40, 8, generator=generator)) / 4  # many ties
    kernels = native_kernels()
    ids, weights = route_native(kernels, logits, 3, normalize=True)
    for t in (0, 17, 39):
        alone_ids, alone_weights = route_native(kernels, logits[t : t + 1], 3, normalize=True)
        assert torch.equal(alone_ids[0], ids[t])
        assert torch.equal(raw_bits(alone_weights[0]), raw_bits(weights[t]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combine_sums_in_slot_order_in_fp32_then_rounds_once(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(2)
    y = torch.randn(12, 40, generator=generator).to(dtype)
    rows = torch.randperm(12, generator=generator).view(4, 3)
    weights = torch.rand(4, 3, generator=generator)
    shared = (torch.randn(4, 40, generator=generator).to(dtype), torch.randn(4, generator=generator))
    out = combine_native(native_kernels(), y, rows, weights, shared)
    acc = torch.zeros(4, 40)
    for j in range(3):  # one fp32 product and one fp32 add per slot, in slot order
        acc = acc + weights[:, j : j + 1] * y[rows[:, j]].float()
    gate = 1.0 / (1.0 + torch.exp(-shared[1]))
    expected = (acc + gate[:, None] * shared[0].float()).to(dtype)
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)  # the gate's exp is ours, not torch's
    no_shared = combine_native(native_kernels(), y, rows, weights)
    assert torch.equal(raw_bits(no_shared), raw_bits(acc.to(dtype)))  # exactly the documented sequence
    if dtype == torch.float32:  # the order is part of the bits (bf16 rounding hides it in 160 values)
        swapped = combine_native(native_kernels(), y, rows[:, [2, 1, 0]], weights[:, [2, 1, 0]])
        assert not torch.equal(raw_bits(swapped), raw_bits(no_shared))


def test_bad_inputs_are_refused() -> None:
    kernels = native_kernels()
    with pytest.raises(ValueError, match="1 <= k <= experts"):
        route_native(kernels, torch.zeros(2, 4), 5, normalize=True)
    with pytest.raises(ValueError, match="fp32"):
        route_native(kernels, torch.zeros(2, 4, dtype=torch.float64), 2, normalize=True)
    with pytest.raises(ValueError, match="outside"):
        combine_native(kernels, torch.zeros(3, 8), torch.tensor([[0, 3]]), torch.ones(1, 2))
