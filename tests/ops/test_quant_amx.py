"""The AMX-INT8 tiles of the quantized GEMM (csrc/quant_amx.c) give the bits of the AVX-512 VNNI tiles,
bitwise, for every 32-value format, stored and repacked, at row counts around the 16-row tile, with 1 and
2 threads. Both paths are in the same -march=native build; the C entry point's TEST_NO_AMX hook runs the
VNNI tiles where the AMX ones would. Skipped where the CPU, the build or the kernel has no AMX tiles (the
batch-invariance and build-comparison tests of test_quant_invariance.py then cover the VNNI path alone)."""

from __future__ import annotations

import pytest
import torch

from deterministic_inference.ops.native import NativeKernels
from deterministic_inference.ops.quant import TEST_NO_AMX, TEST_REVERSE, QuantLinear, uses_amx
from deterministic_inference.ops.quant_probe import random_weight
from tests.ops.helpers import THREADS, bits, num_threads

AMX_FORMATS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
ROW_COUNTS = (16, 17, 31, 32, 33, 50, 64, 100, 512)  # whole tiles, a tile and a remainder, several tiles


@pytest.fixture(scope="module")
def amx_kernels(kernels: NativeKernels) -> NativeKernels:
    if not uses_amx(kernels):
        pytest.skip("no AMX-INT8 tiles here (CPU, build flags or kernel permission)")
    return kernels


def _linear(kernels: NativeKernels, name: str, repack: bool, k: int = 1024) -> QuantLinear:
    """fp32 output, so that any change in the order of the fp32 sums shows."""
    weight = random_weight(name, 80, k, torch.Generator().manual_seed(5))
    return QuantLinear(kernels, [weight], bias=None, out_dtype=torch.float32, repack=repack)


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("repack", [True, False])
@pytest.mark.parametrize("name", AMX_FORMATS)
def test_amx_tiles_give_the_vnni_bits(
    amx_kernels: NativeKernels, name: str, repack: bool, threads: int
) -> None:
    linear = _linear(amx_kernels, name, repack)
    x = torch.randn(max(ROW_COUNTS), 1024, generator=torch.Generator().manual_seed(6)).bfloat16()
    with num_threads(threads):
        for rows in ROW_COUNTS:
            amx = bits(linear.forward_with_flags(x[:rows], 0))
            vnni = bits(linear.forward_with_flags(x[:rows], TEST_NO_AMX))
            assert torch.equal(amx, vnni), f"{name} at M = {rows}"


def test_negative_control_another_block_order_on_the_amx_tiles_is_caught(amx_kernels: NativeKernels) -> None:
    """The comparison above can fail: the AMX tiles taking the blocks in descending order (64 blocks: 4
    chunks of 16) give other bits than the VNNI tiles in ascending order."""
    linear = _linear(amx_kernels, "Q4_1", repack=True, k=2048)
    x = torch.randn(32, 2048, generator=torch.Generator().manual_seed(7)).bfloat16()
    reversed_amx = bits(linear.forward_with_flags(x, TEST_REVERSE))
    assert not torch.equal(reversed_amx, bits(linear.forward_with_flags(x, TEST_NO_AMX)))
    # and the reversed order is the AMX tiles' own: the VNNI tiles reversed give the same bits
    assert torch.equal(reversed_amx, bits(linear.forward_with_flags(x, TEST_REVERSE | TEST_NO_AMX)))
