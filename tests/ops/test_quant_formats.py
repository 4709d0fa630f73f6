"""GGUF block formats as stored (ops/quant.py): dequantisation equals the `gguf` package bit for bit for
every format (random blocks, scales over the whole fp16 range), selected rows (the embedding lookup)
equal the same rows of the whole tensor, Q8_0 quantization writes gguf's bytes, and bad inputs are
refused with clear errors."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from deterministic_inference.ops.native import NativeKernels
from deterministic_inference.ops.quant import (
    FORMATS,
    QuantizedWeight,
    UnsupportedWeightFormat,
    block_format,
    quantize_q8_0,
)
from deterministic_inference.ops.quant_probe import random_weight
from tests.ops.helpers import bits


def _gguf_dequantize(weight: QuantizedWeight) -> torch.Tensor:
    qtype = gguf.GGMLQuantizationType[weight.fmt.name]
    return torch.from_numpy(gguf.quants.dequantize(weight.data.numpy(), qtype).copy())


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("wide", [False, True], ids=["model-scales", "any-fp16-scale"])
def test_dequantize_equals_gguf_bit_for_bit(kernels: NativeKernels, name: str, wide: bool) -> None:
    fmt = FORMATS[name]
    weight = random_weight(fmt, 23, 2 * fmt.block_values * 3, torch.Generator().manual_seed(1), wide=wide)
    expected = _gguf_dequantize(weight)
    assert torch.equal(bits(weight.dequantize(kernels=kernels)), bits(expected))
    assert torch.equal(
        bits(weight.dequantize(dtype=torch.bfloat16, kernels=kernels)), bits(expected.bfloat16())
    )


@pytest.mark.parametrize("name", list(FORMATS))
def test_selected_rows_equal_the_whole_tensors_rows(kernels: NativeKernels, name: str) -> None:
    weight = random_weight(name, 40, FORMATS[name].block_values, torch.Generator().manual_seed(2))
    ids = torch.tensor([39, 0, 7, 7, 21], dtype=torch.int64)  # any order, repeats
    whole = weight.dequantize(kernels=kernels)
    for dtype in (torch.float32, torch.bfloat16):
        rows = weight.dequantize(ids, dtype=dtype, kernels=kernels)
        assert rows.dtype == dtype and torch.equal(bits(rows), bits(whole[ids].to(dtype)))
    assert weight.dequantize(torch.empty(0, dtype=torch.int64), kernels=kernels).shape == (0, weight.shape[1])


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # gguf, on the 1e7 row
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_quantize_q8_0_writes_gguf_bytes(kernels: NativeKernels, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(37, 320, generator=generator) * torch.exp2(
        torch.randint(-20, 8, (37, 1), generator=generator)
    )
    weight[3] = 0.0  # an all-zero block: d = 0, q = 0
    weight[5, :32] = 1e-4  # tiny: d in fp16's subnormal range
    weight[5, 32:64] = 1e-7  # d below fp16's smallest subnormal: stored as 0
    weight[6, :32] = torch.linspace(-3.5, 3.5, 32)  # values landing on .5 after scaling
    if dtype != torch.float16:  # (not representable in fp16 itself)
        weight[7, :32] = 1e7  # d beyond fp16's range: stored as infinity
    weight = weight.to(dtype)
    expected = gguf.quants.quantize(weight.float().numpy(), gguf.GGMLQuantizationType.Q8_0)
    quantized = quantize_q8_0(weight, kernels)
    assert quantized.fmt.name == "Q8_0" and quantized.shape == (37, 320)
    assert np.array_equal(quantized.data.numpy(), expected)


def test_block_format_by_id_and_name() -> None:
    assert block_format(12) == block_format("q4_k") == FORMATS["Q4_K"]
    assert (block_format("Q6_K").block_values, block_format("Q6_K").block_bytes) == (256, 210)
    assert (block_format(8).block_values, block_format(8).block_bytes) == (32, 34)
    for unsupported in ("F16", 0, 1, 30, "Q2_K", "IQ4_NL", 15):
        with pytest.raises(UnsupportedWeightFormat, match="supported: Q4_0"):
            block_format(unsupported)


BAD_WEIGHTS = {  # name: (data, format, shape)
    "int8 data": (torch.zeros(4, 18, dtype=torch.int8), "Q4_0", (4, 32)),
    "row bytes": (torch.zeros(4, 20, dtype=torch.uint8), "Q4_0", (4, 32)),
    "rows": (torch.zeros(5, 18, dtype=torch.uint8), "Q4_0", (4, 32)),
    "k not a block multiple": (torch.zeros(4, 18, dtype=torch.uint8), "Q4_0", (4, 48)),
    "k of a K format": (torch.zeros(4, 144, dtype=torch.uint8), "Q4_K", (4, 128)),
    "strided": (torch.zeros(4, 36, dtype=torch.uint8)[:, ::2], "Q4_0", (4, 32)),
    "1-d": (torch.zeros(72, dtype=torch.uint8), "Q4_0", (4, 32)),
}


@pytest.mark.parametrize("case", list(BAD_WEIGHTS))
def test_quantized_weight_refuses_bytes_it_would_misread(case: str) -> None:
    data, name, shape = BAD_WEIGHTS[case]
    with pytest.raises(ValueError, match=name):
        QuantizedWeight(data, FORMATS[name], shape)


def test_dequantize_refuses_bad_rows_and_dtypes(kernels: NativeKernels) -> None:
    weight = random_weight("Q8_0", 8, 64, torch.Generator().manual_seed(4))
    for rows in (torch.tensor([8]), torch.tensor([-1]), torch.tensor([1.0]), torch.tensor([[1]])):
        with pytest.raises(ValueError, match="row"):
            weight.dequantize(rows, kernels=kernels)
    with pytest.raises(ValueError, match="dtype"):
        weight.dequantize(dtype=torch.float16, kernels=kernels)


@pytest.mark.parametrize(
    "weight",
    [
        torch.ones(4, 48),
        torch.ones(4),
        torch.ones(4, 32, dtype=torch.int32),
        torch.full((2, 32), float("inf")),
    ],
    ids=["k not a multiple of 32", "1-d", "int", "infinite"],
)
def test_quantize_q8_0_refuses_what_it_cannot_represent(kernels: NativeKernels, weight: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="quantize_q8_0"):
        quantize_q8_0(weight, kernels)
