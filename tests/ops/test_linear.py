"""Invariant linears: a row's bits do not depend on M, its position, its neighbours or the thread count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deterministic_inference.ops.linear import Linear
from deterministic_inference.ops.native import NativeKernels
from deterministic_inference.ops.quant_probe import random_weight
from deterministic_inference.ops.weights import dense
from tests.ops.helpers import (
    DTYPES,
    HEAD_DIM,
    HEADS,
    HIDDEN,
    INTER,
    KV_HEADS,
    THREADS,
    VOCAB,
    bits,
    row_mismatches,
)

LAYER_SHAPES = {  # name: (out_features, in_features)
    "qkv": ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN),
    "o_proj": (HIDDEN, HEADS * HEAD_DIM),
    "gate_up": (2 * INTER, HIDDEN),
    "down": (HIDDEN, INTER),
    "tiny_qkv": (128, 64),
    "tiny_down": (64, 128),
}


def _linear(shape: str, dtype: torch.dtype, invariant: bool, **kw: object) -> Linear:
    out_features, in_features = LAYER_SHAPES[shape]
    generator = torch.Generator().manual_seed(1)
    weight = (torch.randn(out_features, in_features, generator=generator) / in_features**0.5).to(dtype)
    return Linear(weight, None, batch_invariant=invariant, **kw)  # type: ignore[arg-type]


def _rows(in_features: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(2, in_features, generator=torch.Generator().manual_seed(2)).to(dtype)


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", list(LAYER_SHAPES))
def test_layer_linears_are_row_invariant(
    kernels: NativeKernels, shape: str, dtype: torch.dtype, threads: int
) -> None:
    """The compiled GEMMs need no padding: every M from 1 to 64 gives a row the same bits."""
    linear = _linear(shape, dtype, invariant=True, kernels=kernels)
    assert linear.backend == ("native" if dtype == torch.bfloat16 else "native_f32")
    assert row_mismatches(linear, _rows(linear.in_features, dtype), threads) == []


@pytest.mark.parametrize("threads", THREADS)
def test_fp32_logits_head_is_row_invariant(kernels: NativeKernels, threads: int) -> None:
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(VOCAB, HIDDEN, generator=generator) / 24
    head = Linear(weight, None, batch_invariant=True, kernels=kernels)
    rows = _rows(HIDDEN, torch.float32)
    assert row_mismatches(head, rows, threads, sizes=(1, 3, 8, 33)) == []


@pytest.mark.parametrize("threads", THREADS)
def test_native_bf16_logits_head_is_row_invariant(kernels: NativeKernels, threads: int) -> None:
    generator = torch.Generator().manual_seed(3)
    weight = (torch.randn(VOCAB, HIDDEN, generator=generator) / 24).bfloat16()
    head = Linear(weight, None, batch_invariant=True, kernels=kernels, out_dtype=torch.float32)
    rows = _rows(HIDDEN, torch.bfloat16)
    out = head(rows)
    assert out.dtype == torch.float32 and head.backend == "native"
    assert row_mismatches(head, rows, threads, sizes=(1, 3, 8, 33)) == []


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_invariant_linear_with_bias_computes_x_wt_plus_b(kernels: NativeKernels, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(96, 64, generator=generator).to(dtype)
    bias = torch.randn(96, generator=generator).to(dtype)
    x = torch.randn(11, 64, generator=generator).to(dtype)
    linear = Linear(weight, bias, batch_invariant=True, kernels=kernels)
    out = linear(x)
    assert out.shape == (11, 96) and out.dtype == dtype
    expected = F.linear(x.float(), weight.float(), bias.float())
    torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=2e-2)
    assert row_mismatches(linear, _rows(64, dtype), threads=2) == []


def test_fp32_weights_use_the_portable_gemm_and_plain_mode_aten(kernels: NativeKernels) -> None:
    fp32 = _linear("qkv", torch.float32, invariant=True, kernels=kernels)
    assert fp32.backend == "native_f32"
    assert row_mismatches(fp32, _rows(fp32.in_features, torch.float32), threads=2) == []
    plain = _linear("qkv", torch.bfloat16, invariant=False, kernels=kernels)
    assert plain.backend == "aten" and not plain.batch_invariant


def test_negative_control_plain_linear_differs() -> None:
    """The same probe on plain F.linear finds differences, so the test above can fail. (bf16 F.linear
    happened to be row-invariant at these shapes on the reference machine; fp32 MKL is not.)"""
    found = {
        (shape, threads): row_mismatches(
            _linear(shape, torch.float32, invariant=False),
            _rows(LAYER_SHAPES[shape][1], torch.float32),
            threads,
        )
        for shape in ("qkv", "down", "tiny_qkv")
        for threads in THREADS
    }
    assert all(found.values()), {key: len(value) for key, value in found.items()}


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_an_invariant_dense_linear_without_kernels_is_refused(dtype: torch.dtype) -> None:
    """torch's GEMMs are not row-invariant on every CPU (oneDNN's AMX kernels differ at M = 33 from
    M = 1), so there is no invariant linear without the compiled kernels."""
    with pytest.raises(ValueError, match="compiled kernels"):
        _linear("tiny_qkv", dtype, invariant=True)


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_native_runs_quantized_weights_on_the_tiles_dequantised_to_bf16(
    amx: NativeKernels, fmt: str, threads: int
) -> None:
    """`--numerics native` on a bf16 model: stacked quantized parts run on the AMX-BF16 GEMM as bf16 weights
    (each value dequantised exactly, rounded to bf16 once, into the tiles), bit for bit the linear built on
    that dense weight, and a row's bits do not depend on the batch; the int8 GEMM's result differs (so the
    test sees which path ran)."""
    generator = torch.Generator().manual_seed(11)
    parts = [random_weight(fmt, rows, 256, generator) for rows in (48, 16)]
    native = Linear(parts, None, batch_invariant=True, kernels=amx, dtype=torch.bfloat16, native_gemm=True)
    assert native.backend == "native" and native.native_gemm and native.formats == ("bf16", "bf16")
    weight = torch.cat([dense(part, torch.float32) for part in parts]).bfloat16()
    reference = Linear(weight, None, batch_invariant=True, kernels=amx, native_gemm=True)
    rows = _rows(256, torch.bfloat16)
    x = torch.randn(37, 256, generator=generator).bfloat16()
    assert torch.equal(bits(native(x)), bits(reference(x)))
    assert row_mismatches(native, rows, threads, sizes=(1, 16, 17, 33)) == []
    quantized = Linear(parts, None, batch_invariant=True, kernels=amx, dtype=torch.bfloat16)
    assert quantized.backend == "quant" and not torch.equal(bits(quantized(x)), bits(native(x)))


def test_native_keeps_quantized_weights_of_an_fp32_model(amx: NativeKernels) -> None:
    """The tiles take bf16 only: under `--dtype float32` a quantized linear stays on the quantized GEMM."""
    weight = random_weight("Q8_0", 32, 64, torch.Generator().manual_seed(12))
    linear = Linear(weight, None, batch_invariant=True, kernels=amx, dtype=torch.float32, native_gemm=True)
    assert linear.backend == "quant" and not linear.native_gemm
