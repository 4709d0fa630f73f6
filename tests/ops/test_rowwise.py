"""RMSNorm, rotary and exp (torch ops): every output row is a function of that row's data only."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deterministic_inference.ops.norm import rms_norm
from deterministic_inference.ops.rope import RotaryTable
from tests.ops.helpers import (
    DTYPES,
    HEAD_DIM,
    HEADS,
    HIDDEN,
    THREADS,
    TINY_HEAD_DIM,
    TINY_HEADS,
    TINY_HIDDEN,
    bits,
    row_mismatches,
)

DTYPE_IDS = ["fp32", "bf16"]


def _rows(width: int, dtype: torch.dtype, scale: float = 1.0, count: int = 4) -> torch.Tensor:
    """Probe rows (the probe cycles through them; differences are data-dependent, so several)."""
    return (scale * torch.randn(count, width, generator=torch.Generator().manual_seed(7))).to(dtype)


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("width", [HIDDEN, HEAD_DIM, TINY_HIDDEN, TINY_HEAD_DIM])
def test_rms_norm_is_row_invariant(width: int, dtype: torch.dtype, threads: int) -> None:
    weight = (1 + 0.1 * torch.randn(width, generator=torch.Generator().manual_seed(8))).to(dtype)
    assert row_mismatches(lambda x: rms_norm(x, weight, 1e-5), _rows(width, dtype), threads) == []


def test_negative_control_rms_norm_in_bf16_differs() -> None:
    """Statistics computed in bf16 (what rms_norm avoids by upcasting) depend on M: the probe sees it."""
    weight = torch.ones(HIDDEN, dtype=torch.bfloat16)

    def bf16_norm(x: torch.Tensor) -> torch.Tensor:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))

    assert row_mismatches(bf16_norm, _rows(HIDDEN, torch.bfloat16, count=8), threads=1) != []


def test_negative_control_plain_silu_differs() -> None:
    """F.silu's vector body and scalar tail round differently; with a width that is not a multiple of 32
    the tail moves with M and the probe finds it (why invariant mode runs silu_mul in the compiled
    kernel, tested in test_native_rowwise.py)."""
    assert row_mismatches(lambda x: F.silu(x) * x, _rows(40, torch.float32, 3.0, count=8), threads=1) != []


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(("heads", "head_dim"), [(HEADS, HEAD_DIM), (TINY_HEADS, TINY_HEAD_DIM)])
def test_rotary_is_row_invariant(heads: int, head_dim: int, dtype: torch.dtype, threads: int) -> None:
    """A row's rotation depends on its position only (table lookup + exact elementwise ops). No plain
    variant exists to use as a negative control; the probe itself is shown to fail in the tests above."""
    table = RotaryTable(head_dim, 10000.0, 2048, None)

    def rope(x: torch.Tensor) -> torch.Tensor:
        positions = (x[:, 0].float().abs() * 1000).long() % 2048  # derived from the row's own data
        return table.apply(x.view(-1, heads, head_dim), positions).reshape(x.shape[0], -1)

    assert row_mismatches(rope, _rows(heads * head_dim, dtype), threads) == []


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rotary_equals_hf_rotate_half_bitwise(dtype: torch.dtype) -> None:
    """The cat-free rotation gives HF's x * cos + rotate_half(x) * sin bit for bit."""
    table = RotaryTable(HEAD_DIM, 10000.0, 2048, None)
    x = torch.randn(33, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(4)).to(dtype)
    positions = torch.randint(0, 2048, (33,), generator=torch.Generator().manual_seed(5))
    cos = table.cos[positions].unsqueeze(1).to(dtype)
    sin = table.sin[positions].unsqueeze(1).to(dtype)
    half = HEAD_DIM // 2
    expected = x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
    assert torch.equal(bits(table.apply(x, positions)), bits(expected))


def test_exp_scalar_and_vector_kernels_agree() -> None:
    """Plain-mode ops rely on torch.exp giving the same bits in its scalar (strided input)
    and vectorised (contiguous input) kernels; F.silu and sigmoid do not (measured)."""
    values = torch.randn(1 << 18, 2, generator=torch.Generator().manual_seed(9)) * 12
    strided = values[:, 0]
    assert torch.equal(bits(torch.exp(strided)), bits(torch.exp(strided.contiguous())))
    assert not torch.equal(bits(F.silu(strided)), bits(F.silu(strided.contiguous())))
