"""The Gemma ops in our C kernels (csrc/rowwise.c): GELU-tanh GeGLU and logit soft-capping. Close to torch's
float64 reference and row-invariant (a row alone equals the row in any batch, 1 or 2 threads); that the
bits are fixed by our source (the same for another -march) is tests/ops/test_portable.py's all_outputs."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from deterministic_inference.ops.native import native_kernels
from tests.ops.helpers import DTYPES, THREADS, bits, row_mismatches

WIDTHS = [40, 128, 1152]  # not a multiple of 32, a power of two, Gemma 3 1B's hidden width


def _gate_up(rows: int, inter: int, dtype: torch.dtype, scale: float = 3.0) -> torch.Tensor:
    return (scale * torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(3))).to(dtype)


def test_gelu_tanh_mul_matches_torch_in_float64() -> None:
    """Within 1e-5 absolute, as torch's own fp32 gelu (1 + tanh cancels for large negative gates)."""
    gate_up = _gate_up(64, 512, torch.float32)
    gate, up = gate_up.double().chunk(2, dim=1)
    expected = F.gelu(gate, approximate="tanh") * up
    ours = native_kernels().gelu_tanh_mul(gate_up).double()
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-5)


def test_gelu_tanh_mul_bf16_rounds_like_torch() -> None:
    """bf16: gelu rounded to bf16, then the product rounded (torch's bf16 ops): 1 bf16 ulp or 1e-5 apart."""
    gate_up = _gate_up(64, 512, torch.bfloat16)
    gate, up = gate_up.chunk(2, dim=1)
    expected = (F.gelu(gate.float(), approximate="tanh").bfloat16() * up).float()
    ours = native_kernels().gelu_tanh_mul(gate_up).float()
    torch.testing.assert_close(ours, expected, rtol=2**-7, atol=1e-5)


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("inter", WIDTHS)
def test_gelu_tanh_mul_is_row_invariant(inter: int, dtype: torch.dtype, threads: int) -> None:
    kernels = native_kernels()
    assert row_mismatches(kernels.gelu_tanh_mul, _gate_up(4, inter, dtype), threads) == []


def test_softcap_matches_tanh_and_is_row_invariant() -> None:
    kernels = native_kernels()
    logits = 40 * torch.randn(16, 1000, generator=torch.Generator().manual_seed(4))
    expected = torch.tanh(logits.double() / 30.0) * 30.0
    torch.testing.assert_close(kernels.softcap(logits, 30.0).double(), expected, rtol=1e-6, atol=2e-6)
    assert row_mismatches(lambda x: kernels.softcap(x, 30.0), logits[:4], threads=2) == []
    extremes = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e4, -1e4, math.inf, -math.inf])
    capped = kernels.softcap(extremes, 30.0)
    assert capped.tolist()[4:] == [30.0, -30.0, 30.0, -30.0]
    assert torch.equal(bits(capped[:2]), bits(torch.tensor([0.0, -0.0])))


def test_softcap_refuses_a_non_fp32_input() -> None:
    with pytest.raises(ValueError, match="fp32"):
        native_kernels().softcap(torch.zeros(4, dtype=torch.bfloat16), 30.0)
