"""Batch invariance of the quantized GEMM, bitwise: a row's output does not depend on M (1..512), its
position, its neighbours, the thread count (1 vs 2), the build flags (-march=native / x86-64-v3 /
x86-64) or the other parts of a multi-part linear. Each property has a negative control: a deliberately
broken variant (the C entry point's test hooks) that the same comparison catches."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from deterministic_inference.ops.native import NativeKernels
from deterministic_inference.ops.quant import (
    FORMATS,
    TEST_BATCH_SCALE,
    TEST_REVERSE,
    TEST_REVERSE_ODD_THREADS,
    QuantizedWeight,
    QuantLinear,
)
from deterministic_inference.ops.quant_probe import random_weight
from tests.ops.helpers import BATCH_SIZES, THREADS, bits, num_threads, row_mismatches

SIZES = (*BATCH_SIZES, 100, 257, 512)  # 1..64 around the row tiles, then up to 512


def _linear(
    kernels: NativeKernels, name: str, out_features: int = 256, k: int = 1024, seed: int = 1
) -> QuantLinear:
    """fp32 output: every change in the order of the fp32 sums shows (bf16 rounding would hide most)."""
    weight = random_weight(name, out_features, k, torch.Generator().manual_seed(seed))
    return QuantLinear(kernels, [weight], bias=None, out_dtype=torch.float32)


def _rows(k: int, dtype: torch.dtype = torch.bfloat16, count: int = 3) -> torch.Tensor:
    return torch.randn(count, k, generator=torch.Generator().manual_seed(2)).to(dtype)


def _flagged(linear: QuantLinear, flags: int) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: linear.forward_with_flags(x, flags)


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("name", list(FORMATS))
def test_rows_alone_equal_rows_in_batches_of_1_to_512(
    kernels: NativeKernels, name: str, threads: int
) -> None:
    linear = _linear(kernels, name)
    for dtype in (torch.bfloat16, torch.float32):
        assert row_mismatches(linear, _rows(1024, dtype), threads, sizes=SIZES) == [], dtype


@pytest.mark.parametrize("name", ["Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_every_position_of_a_batch(kernels: NativeKernels, name: str) -> None:
    """Each of 300 distinct rows computed inside the batch (2 threads) equals it computed alone."""
    linear = _linear(kernels, name, out_features=64, k=512)
    batch = torch.randn(300, 512, generator=torch.Generator().manual_seed(3)).bfloat16()
    with num_threads(2):
        together = bits(linear(batch))
    with num_threads(1):
        alone = torch.cat([bits(linear(batch[i : i + 1])) for i in range(300)])
    assert torch.equal(together, alone)


def test_negative_control_batch_wide_activation_scale_is_caught(kernels: NativeKernels) -> None:
    """The probe above finds the difference when each activation block's scale is taken over the whole
    batch (the C test hook), for a 32-value and a K format."""
    for name in ("Q4_0", "Q4_K"):
        broken = _flagged(_linear(kernels, name), TEST_BATCH_SCALE)
        assert row_mismatches(broken, _rows(1024), threads=1, sizes=SIZES), name


def test_negative_control_thread_dependent_block_order_is_caught(kernels: NativeKernels) -> None:
    """With odd-numbered threads adding the blocks in the other order, 1 vs 2 threads differ."""
    for name in ("Q8_0", "Q5_K"):
        broken = _flagged(_linear(kernels, name), TEST_REVERSE_ODD_THREADS)
        assert row_mismatches(broken, _rows(1024), threads=2, sizes=SIZES), name
        assert row_mismatches(broken, _rows(1024), threads=1, sizes=SIZES) == [], name  # needs 2 threads


def _mixed_parts(seed: int) -> tuple[list[QuantizedWeight], list[torch.Tensor | None]]:
    """q, k, v-like parts in different formats (a Q4_K_M file keeps attn_v in Q6_K), two row orders."""
    generator = torch.Generator().manual_seed(seed)
    parts = [
        random_weight(name, rows, 1024, generator)
        for name, rows in (("Q4_K", 96), ("Q6_K", 40), ("Q8_0", 24))
    ]
    orders = [torch.randperm(96, generator=generator), None, torch.randperm(24, generator=generator)]
    return parts, orders


def _reordered(weight: QuantizedWeight, order: torch.Tensor | None) -> QuantizedWeight:
    data = weight.data if order is None else weight.data[order].contiguous()
    return QuantizedWeight(data, weight.fmt, weight.shape)


def test_multi_part_linear_equals_its_parts_through_their_row_orders(kernels: NativeKernels) -> None:
    parts, orders = _mixed_parts(4)
    bias = torch.randn(160, generator=torch.Generator().manual_seed(5))
    fused = QuantLinear(kernels, parts, bias=bias, out_dtype=torch.float32, row_orders=orders)
    assert fused.formats == ("Q4_K", "Q6_K", "Q8_0") and (fused.out_features, fused.in_features) == (
        160,
        1024,
    )
    x = torch.randn(7, 1024, generator=torch.Generator().manual_seed(6)).bfloat16()
    pieces, start = [], 0
    for part, order in zip(parts, orders, strict=True):
        single = QuantLinear(kernels, [_reordered(part, order)], bias=bias[start : start + part.shape[0]],
                             out_dtype=torch.float32)  # fmt: skip
        pieces.append(single(x))
        start += part.shape[0]
    assert torch.equal(bits(fused(x)), bits(torch.cat(pieces, dim=1)))
    for threads in THREADS:
        assert row_mismatches(fused, _rows(1024), threads, sizes=SIZES) == [], threads


def _build_cases(kernels: NativeKernels) -> dict[str, QuantLinear]:
    generator = torch.Generator().manual_seed(7)
    cases = {}
    for name in FORMATS:
        weight = random_weight(name, 80, 1024, generator)
        cases[name] = QuantLinear(
            kernels, [weight], bias=torch.randn(80, generator=generator), out_dtype=torch.float32
        )
    parts, orders = _mixed_parts(8)
    cases["mixed"] = QuantLinear(kernels, parts, bias=None, out_dtype=torch.float32, row_orders=orders)
    cases["mixed-bf16-out"] = QuantLinear(
        kernels, parts, bias=None, out_dtype=torch.bfloat16, row_orders=orders
    )
    return cases


def _outputs(lib: NativeKernels, cases: dict[str, QuantLinear], flags: int = 0) -> dict[str, torch.Tensor]:
    x = torch.randn(33, 1024, generator=torch.Generator().manual_seed(9))
    outputs = {}
    for name, case in cases.items():
        rebuilt = QuantLinear(
            lib, case.parts, bias=case.bias, out_dtype=case.out_dtype, row_orders=case.row_orders
        )
        outputs[name] = bits(rebuilt.forward_with_flags(x[:, : case.in_features].contiguous(), flags))
    return outputs


def test_builds_give_the_same_bits(kernels: NativeKernels, march_builds: dict[str, NativeKernels]) -> None:
    """-march=native (AVX-512 VNNI here), x86-64-v3 (AVX2) and x86-64 (portable C): every format, a
    mixed multi-part linear with row orders, bias, fp32 and bf16 output."""
    cases = _build_cases(kernels)
    reference = _outputs(kernels, cases)
    for flags, lib in march_builds.items():
        found = _outputs(lib, cases)
        assert all(torch.equal(found[name], reference[name]) for name in cases), flags


def test_negative_control_a_different_block_order_between_builds_is_caught(kernels: NativeKernels) -> None:
    """The build comparison above detects a build whose blocks go in another order (every fp32-output
    case differs; bf16 rounding hides most such changes, which is why the other cases output fp32)."""
    cases = _build_cases(kernels)
    reference, reversed_order = _outputs(kernels, cases), _outputs(kernels, cases, TEST_REVERSE)
    fp32_cases = [name for name, case in cases.items() if case.out_dtype == torch.float32]
    assert len(fp32_cases) == len(FORMATS) + 1
    assert all(not torch.equal(reference[name], reversed_order[name]) for name in fp32_cases)
