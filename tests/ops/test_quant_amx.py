"""The AMX-INT8 tiles of the quantized GEMM (csrc/quant_amx.c) give the bits of the AVX-512 VNNI tiles,
bitwise, for every 32-value format, stored and repacked, at row counts around the 16-row tile, with 1 and
2 threads, and on blocks at the integer sums' extremes (the tiles multiply the weights made signed, the
VNNI tiles the unsigned bytes with an integer correction). Both paths are in the same -march=native
build; the C entry point's TEST_NO_AMX hook runs the VNNI tiles where the AMX ones would. Skipped where
the CPU, the build or the kernel has no AMX tiles (the batch-invariance and build-comparison tests of
test_quant_invariance.py then cover the VNNI path alone)."""

from __future__ import annotations

import pytest
import torch

from deterministic_inference.ops.native import NativeKernels
from deterministic_inference.ops.quant import (
    TEST_AMX_UNSIGNED,
    TEST_NO_AMX,
    TEST_REVERSE,
    QuantLinear,
    uses_amx,
)
from deterministic_inference.ops.quant_probe import random_weight
from tests.ops.helpers import THREADS, bits, num_threads

AMX_FORMATS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
# whole tiles; a tile and a remainder of 1-9 rows (VNNI tiles) or of 10-15 (a last AMX tile with padding
# rows: 26, 27, 31, 300); several tiles
ROW_COUNTS = (16, 17, 25, 26, 27, 31, 32, 33, 50, 64, 100, 300, 512)


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


def _extreme_rows(k: int) -> torch.Tensor:
    """48 rows (3 tiles) of blocks at the edges of the activation quantization: a constant block (every
    q = +127 or -127), alternating +-x (q = +-127), one large value among tiny ones, a zero block, blocks
    under 2^-120 (d = 0), an inf and a NaN block (d = NaN), and random blocks; fp32, so nothing rounds."""
    generator = torch.Generator().manual_seed(8)
    rows = torch.randn(48, k, generator=generator)
    blocks = rows.view(48, k // 32, 32)
    signs = torch.tensor([1.0, -1.0]).repeat(16)
    for r in range(48):
        kind = r % 8
        if kind == 0:
            blocks[r] = 3.5 if r % 16 == 0 else -3.5
        elif kind == 1:
            blocks[r] = signs * 0.75
        elif kind == 2:
            blocks[r] = 1e-3
            blocks[r, :, 5] = 40.0
        elif kind == 3:
            blocks[r, ::2] = 0.0
            blocks[r, 1::2] = 2.0**-126
        elif kind == 4:
            blocks[r, 3, 7] = float("inf")
            blocks[r, 9, 0] = float("nan")
    return rows


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("name", AMX_FORMATS)
def test_amx_tiles_give_the_vnni_bits_on_extreme_blocks(
    amx_kernels: NativeKernels, name: str, threads: int
) -> None:
    """The largest integer sums both ways: weights with every byte 0xFF, 0x00 or 0x80 (Q4_0 -> +7 / -8, Q8_0
    -> -1 / 0 / -128, Q5 with all high bits) and random ones, against activation blocks of q = +-127."""
    weight = random_weight(name, 96, 1024, torch.Generator().manual_seed(9))
    fields = weight.data.view(96, -1, weight.fmt.block_bytes)
    scale_bytes = 4 if name in ("Q4_1", "Q5_1") else 2
    fields[:32, :, scale_bytes:] = 0xFF
    fields[32:48, :, scale_bytes:] = 0x00
    fields[48:64, :, scale_bytes:] = 0x80  # Q8_0: -128
    linear = QuantLinear(amx_kernels, [weight], bias=None, out_dtype=torch.float32)
    x = _extreme_rows(1024)
    with num_threads(threads):
        amx = bits(linear.forward_with_flags(x, 0))
        vnni = bits(linear.forward_with_flags(x, TEST_NO_AMX))
    assert torch.equal(amx, vnni), name


def test_negative_control_unsigned_weights_on_the_amx_tiles_are_caught(amx_kernels: NativeKernels) -> None:
    """The comparison can fail on the integer sums: the tiles summing the unsigned weight bytes (the signed
    conversion skipped) give other bits for every format with an offset, and the same bits for Q4_1 / Q5_1,
    which have none."""
    x = torch.randn(32, 1024, generator=torch.Generator().manual_seed(10)).bfloat16()
    for name in AMX_FORMATS:
        linear = _linear(amx_kernels, name, repack=True)
        unsigned = bits(linear.forward_with_flags(x, TEST_AMX_UNSIGNED))
        vnni = bits(linear.forward_with_flags(x, TEST_NO_AMX))
        assert torch.equal(unsigned, vnni) == (name in ("Q4_1", "Q5_1")), name
