"""RMSNorm, silu_mul, rotary and exp: every output row is a function of that row's data only."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deterministic_inference.ops.activation import silu_mul
from deterministic_inference.ops.norm import rms_norm
from deterministic_inference.ops.rope import RotaryTable
from tests.ops.helpers import (
    DTYPES,
    HEAD_DIM,
    HEADS,
    HIDDEN,
    INTER,
    THREADS,
    TINY_HEAD_DIM,
    TINY_HEADS,
    TINY_HIDDEN,
    TINY_INTER,
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


def _mlp_layout(width: int, invariant: bool) -> object:
    """silu_mul on slices of one fused gate_up output, as the model calls it."""
    return lambda x: silu_mul(x[:, :width], x[:, width:], batch_invariant=invariant)


def _contiguous(invariant: bool) -> object:
    """silu_mul on a contiguous gate (up = gate): the layout where F.silu's scalar tail moves with M."""
    return lambda x: silu_mul(x, x, batch_invariant=invariant)


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("width", [INTER, TINY_INTER, 40])
def test_silu_mul_is_row_invariant(width: int, dtype: torch.dtype, threads: int) -> None:
    assert row_mismatches(_mlp_layout(width, True), _rows(2 * width, dtype, 3.0), threads) == []  # type: ignore[arg-type]
    assert row_mismatches(_contiguous(True), _rows(width, dtype, 3.0), threads) == []  # type: ignore[arg-type]


def test_negative_control_plain_silu_differs() -> None:
    """F.silu's vector body and scalar tail round differently; with a width that is not a multiple of 32
    the tail moves with M and the same probe finds it."""
    assert row_mismatches(_contiguous(False), _rows(40, torch.float32, 3.0, count=8), threads=1) != []  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_silu_mul_matches_f_silu(dtype: torch.dtype) -> None:
    gate_up = _rows(2 * INTER, dtype, 3.0).repeat(5, 1)
    gate, up = gate_up[:, :INTER], gate_up[:, INTER:]
    out = silu_mul(gate, up)
    assert out.dtype == dtype
    torch.testing.assert_close(
        out, F.silu(gate) * up, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5
    )


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
    """silu_mul and attention rely on torch.exp giving the same bits in its scalar (strided input)
    and vectorised (contiguous input) kernels; F.silu and sigmoid do not (measured)."""
    values = torch.randn(1 << 18, 2, generator=torch.Generator().manual_seed(9)) * 12
    strided = values[:, 0]
    assert torch.equal(bits(torch.exp(strided)), bits(torch.exp(strided.contiguous())))
    assert not torch.equal(bits(F.silu(strided)), bits(F.silu(strided.contiguous())))
