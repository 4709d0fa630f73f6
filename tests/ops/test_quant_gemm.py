"""The quantized-weight GEMM (ops/csrc/quant*.c): every output element is exactly the float sequence
documented in quant.h (a numpy re-enactment in tests/ops/quant_reference.py checks every element, on
the VNNI build and the portable one), it is close to float64, and it refuses inputs it would misread.
Row, thread, build and multi-part invariance are in test_quant_invariance.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from deterministic_inference.ops.native import NativeKernels
from deterministic_inference.ops.quant import FORMATS, QuantizedWeight, QuantLinear
from deterministic_inference.ops.quant_probe import random_weight
from tests.ops.helpers import bits
from tests.ops.quant_reference import documented_output, float64_reference

BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def portable(march_builds: dict[str, NativeKernels]) -> NativeKernels:
    """-march=x86-64: no AVX at all, the portable C path with libm's fmaf."""
    return march_builds["x86-64"]


def _case(name: str, rows: int, out_features: int, seed: int) -> tuple[QuantizedWeight, torch.Tensor]:
    """A weight spanning 3 chunks of 16 units (2.5 for the 32-value formats) and rows with outliers."""
    generator = torch.Generator().manual_seed(seed)
    k = 1280 if FORMATS[name].block_values == 32 else 1536
    weight = random_weight(name, out_features, k, generator)
    x = torch.randn(rows, k, generator=generator) * torch.exp2(
        torch.randint(-4, 4, (rows, 1), generator=generator)
    )
    x[0, 5] = 40.0  # one block dominated by an outlier
    x[-1, 64:96] = 0.0  # an all-zero block (the last row: the first too when there is one row)
    return weight, x


# 1..4: the few-row loops; 6: those loops 4 rows at a time on a repacked format (csrc/quant_gemm.c
# fused_row_limit), the unpacking path on the others; 70: the unpacking path on every format
@pytest.mark.parametrize("rows", [1, 4, 6, 70], ids=lambda m: f"M={m}")
@pytest.mark.parametrize("name", list(FORMATS))
def test_every_element_is_the_documented_sequence(
    kernels: NativeKernels, portable: NativeKernels, name: str, rows: int
) -> None:
    weight, x = _case(name, rows, 45, seed=1)  # 45 columns: a full panel and a partial one
    bias = torch.randn(45, generator=torch.Generator().manual_seed(2))
    expected = documented_output(x, weight, bias)
    for label, lib in (("native", kernels), ("x86-64", portable)):
        out = QuantLinear(lib, [weight], bias=bias, out_dtype=torch.float32)(x)
        assert torch.equal(bits(out), bits(expected)), label
        bf16 = QuantLinear(lib, [weight], bias=bias, out_dtype=BF16)(x.bfloat16())
        assert torch.equal(bits(bf16), bits(documented_output(x.bfloat16(), weight, bias).bfloat16())), label


@pytest.mark.parametrize("name", [name for name, fmt in FORMATS.items() if fmt.block_values == 32])
def test_odd_block_counts_and_narrow_parts(
    kernels: NativeKernels, portable: NativeKernels, name: str
) -> None:
    """3 blocks per row (the unpacking goes by pairs of blocks) and 5 columns (one partial half panel)."""
    generator = torch.Generator().manual_seed(9)
    weight = random_weight(name, 5, 96, generator)
    for rows in (1, 5):
        x = torch.randn(rows, 96, generator=generator)
        expected = bits(documented_output(x, weight))
        for lib in (kernels, portable):
            out = QuantLinear(lib, [weight], bias=None, out_dtype=torch.float32)(x)
            assert torch.equal(bits(out), expected)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q6_K"])
def test_negative_control_other_orders_and_scales_are_caught(kernels: NativeKernels, name: str) -> None:
    """The element-wise comparison above can fail: the blocks added in descending order, or an
    activation scale shared by all rows, change some outputs."""
    weight, x = _case(name, 6, 45, seed=3)
    out = bits(QuantLinear(kernels, [weight], bias=None, out_dtype=torch.float32)(x))
    assert torch.equal(out, bits(documented_output(x, weight)))
    assert not torch.equal(out, bits(documented_output(x, weight, descending=True)))
    assert not torch.equal(out, bits(documented_output(x, weight, shared_amax=True)))


@pytest.mark.parametrize("name", list(FORMATS))
def test_close_to_float64(kernels: NativeKernels, name: str) -> None:
    """|kernel - x W^T| stays within the activation rounding bound (float64_reference's docstring)."""
    weight, x = _case(name, 9, 70, seed=4)
    exact, bound = float64_reference(x, weight)
    out = QuantLinear(kernels, [weight], bias=None, out_dtype=torch.float32)(x).double()
    error = (out - exact).abs()
    assert (error <= bound).all(), float((error / bound).max())
    assert float((error / bound).median()) < 0.25  # the bound is not vacuous: typical errors sit well inside


@pytest.mark.parametrize(
    ("out_dtype", "view", "quiet_nan"),
    [(torch.float32, torch.int32, 0x7FC00000), (torch.bfloat16, torch.int16, 0x7FC0)],
)
def test_non_finite_activations_give_nan_rows_only(
    kernels: NativeKernels, out_dtype: torch.dtype, view: torch.dtype, quiet_nan: int
) -> None:
    weight, x = _case("Q8_0", 4, 40, seed=5)
    x[1, 7], x[2, 300] = float("inf"), float("nan")
    out = QuantLinear(kernels, [weight], bias=torch.ones(40), out_dtype=out_dtype)(x)
    assert out[1:3].isnan().all() and not out[[0, 3]].isnan().any()
    assert (out[1:3].view(view) == quiet_nan).all()  # the one canonical quiet NaN


def test_tiny_activation_blocks_read_as_zero(kernels: NativeKernels) -> None:
    weight = random_weight("Q4_0", 16, 64, torch.Generator().manual_seed(6))
    x = torch.zeros(1, 64)
    x[0, :32] = 2.0**-121  # below 2^-120: the block quantizes to zero
    out = QuantLinear(kernels, [weight], bias=None, out_dtype=torch.float32)(x)
    assert (out.view(torch.int32) == 0).all()


def test_no_rows_gives_an_empty_result(kernels: NativeKernels) -> None:
    weight = random_weight("Q4_K", 20, 256, torch.Generator().manual_seed(7))
    out = QuantLinear(kernels, [weight], bias=None, out_dtype=BF16)(torch.empty(0, 256, dtype=BF16))
    assert out.shape == (0, 20) and out.dtype == BF16


def _weights() -> tuple[QuantizedWeight, QuantizedWeight]:
    generator = torch.Generator().manual_seed(8)
    return random_weight("Q4_K", 20, 256, generator), random_weight("Q8_0", 12, 512, generator)


BAD_CALLS = {  # name: (x, match)
    "fp16 x": (torch.ones(3, 256, dtype=torch.float16), "bf16 or fp32"),
    "wrong k": (torch.ones(3, 512), r"\[M, 256\]"),
    "1-d x": (torch.ones(256), r"\[M, 256\]"),
    "int x": (torch.ones(3, 256, dtype=torch.int32), "bf16 or fp32"),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_call_refuses_inputs_it_would_misread(kernels: NativeKernels, case: str) -> None:
    x, match = BAD_CALLS[case]
    linear = QuantLinear(kernels, [_weights()[0]], bias=None, out_dtype=torch.float32)
    with pytest.raises(ValueError, match=match):
        linear(x)


def test_strided_activations_are_read_correctly(kernels: NativeKernels) -> None:
    linear = QuantLinear(kernels, [_weights()[0]], bias=None, out_dtype=torch.float32)
    x = torch.randn(512, 5).T  # [5, 512] non-contiguous
    assert torch.equal(bits(linear(x[:, :256])), bits(linear(x[:, :256].contiguous())))


def test_constructor_refuses_what_the_kernel_would_misread(kernels: NativeKernels) -> None:
    q4k, q8 = _weights()
    order = torch.arange(20)
    bad: dict[str, tuple[dict[str, Any], str]] = {
        "no parts": (dict(parts=[]), "one or more"),
        "not a weight": (dict(parts=[torch.zeros(20, 144, dtype=torch.uint8)]), "QuantizedWeight"),
        "in_features differ": (dict(parts=[q4k, q8]), "same in_features"),
        "fp16 out": (dict(out_dtype=torch.float16), "out_dtype"),
        "short bias": (dict(bias=torch.ones(19)), r"bias .*\[20\]"),
        "int bias": (dict(bias=torch.ones(20, dtype=torch.int64)), "bias"),
        "orders count": (dict(row_orders=[order, order]), "2 row orders for 1 parts"),
        "order dtype": (dict(row_orders=[order.int()]), "int64"),
        "order length": (dict(row_orders=[order[:19]]), r"\[20\]"),
        "order range": (dict(row_orders=[order + 1]), r"outside \[0, 20\)"),
        "negative order": (dict(row_orders=[order - 1]), "outside"),
    }
    for label, (changes, match) in bad.items():
        arguments = dict(parts=[q4k], bias=None, out_dtype=torch.float32, row_orders=None) | changes
        with pytest.raises(ValueError, match=match):
            QuantLinear(kernels, arguments.pop("parts"), **arguments)  # type: ignore[arg-type]
        assert label
