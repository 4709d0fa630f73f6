"""`--numerics native` on quantized weights read in place (ops/csrc/quant_tiles.c, gemm_amx.h): each panel of
blocks is dequantised into AMX-BF16 tiles as the GEMM reaches it. Its bits must be those of the AMX-BF16 GEMM
on the weight dequantised to bf16 at load (exactly, as gguf does) and packed, for every block format, for
stacked parts read repacked or as stored (a part of 40 rows; Q5_0 / Q5_1, never repacked), through a row
order, on the small calls' path and the chunked one (200 rows at K = 4096), at 1 and 2 threads; and a
row's bits must not depend on the batch. A linear whose parts would split a 16-column block is dequantised
at load instead, with the same bits. Negative control: a build cutting each dequantised value to bf16 instead
of rounding it is caught. Skipped where the CPU or OS has no AMX-BF16; a build without the tiles refusing
the call is tested everywhere, and the tiles read from repacked panels against those of the stored blocks
wherever the tile code is built (AVX-512 VBMI), AMX or not."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch

from deterministic_inference.ops.linear import Linear
from deterministic_inference.ops.native import NativeKernels, load
from deterministic_inference.ops.native_build import build
from deterministic_inference.ops.quant import QuantLinear, tiles_fit
from deterministic_inference.ops.quant_probe import SCALE_FIELDS, random_weight
from deterministic_inference.ops.weights import RowOrdered, StoredWeight, dense
from tests.ops.helpers import THREADS, bits, num_threads, row_mismatches

FORMATS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
K = 512  # a whole number of K super-blocks
CHUNKED_K, CHUNKED_ROWS = 4096, 200  # x over 1.5 MiB: the chunked path


def _parts(fmt: str, rows: tuple[int, ...], k: int, seed: int) -> list[StoredWeight]:
    """Parts of `rows` rows; the first read through a row order (a reversed permutation)."""
    generator = torch.Generator().manual_seed(seed)
    parts: list[StoredWeight] = [random_weight(fmt, count, k, generator) for count in rows]
    first = parts[0]
    assert not isinstance(first, torch.Tensor | RowOrdered)
    parts[0] = RowOrdered(first, torch.arange(rows[0] - 1, -1, -1))
    return parts


def _pair(amx: NativeKernels, parts: list[StoredWeight], out_dtype: torch.dtype) -> tuple[Linear, Linear]:
    """(the linear on the blocks as stored, the one on the weight dequantised to bf16 at load): native."""
    bias = torch.randn(sum(part.shape[0] for part in parts), generator=torch.Generator().manual_seed(5))
    common = {"batch_invariant": True, "kernels": amx, "out_dtype": out_dtype, "native_gemm": True}
    stored = Linear(parts, bias, dtype=torch.bfloat16, **common)  # type: ignore[arg-type]
    weight = torch.cat([dense(part, torch.bfloat16) for part in parts])
    return stored, Linear(weight, bias, dtype=torch.bfloat16, **common)  # type: ignore[arg-type]


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_tiles_give_the_bits_of_the_weight_dequantised_at_load(
    amx: NativeKernels, fmt: str, threads: int
) -> None:
    generator = torch.Generator().manual_seed(7)
    for rows, out_dtype in (((48, 16), torch.bfloat16), ((32, 40), torch.float32)):
        stored, reference = _pair(amx, _parts(fmt, rows, K, 3), out_dtype)
        assert stored.quant_tiles is not None and stored.native_gemm and stored.formats == ("bf16", "bf16")
        x = torch.randn(37, K, generator=generator).bfloat16()
        with num_threads(threads):
            assert torch.equal(bits(stored(x)), bits(reference(x))), (rows, out_dtype)
    probe = torch.randn(2, K, generator=generator).bfloat16()
    assert row_mismatches(stored, probe, threads, sizes=(1, 16, 17, 33)) == []


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q6_K"])
def test_the_chunked_path_gives_the_same_bits(amx: NativeKernels, fmt: str) -> None:
    stored, reference = _pair(amx, _parts(fmt, (32, 24), CHUNKED_K, 4), torch.bfloat16)
    x = torch.randn(CHUNKED_ROWS, CHUNKED_K, generator=torch.Generator().manual_seed(8)).bfloat16()
    for threads in THREADS:
        with num_threads(threads):
            out = bits(stored(x))
            assert torch.equal(out, bits(reference(x)))
            assert torch.equal(out[:1], bits(stored(x[:1])))  # a row alone: the small calls' path


def test_parts_that_would_split_a_block_are_dequantised_at_load(amx: NativeKernels) -> None:
    stored, reference = _pair(amx, _parts("Q4_1", (40, 16), K, 6), torch.bfloat16)
    assert stored.quant_tiles is None and stored.native_gemm  # 40 rows, then more: the dense AMX path
    x = torch.randn(19, K, generator=torch.Generator().manual_seed(9)).bfloat16()
    assert torch.equal(bits(stored(x)), bits(reference(x)))
    parts = _parts("Q4_1", (40, 16), K, 6)
    blocks = [part.stored if isinstance(part, RowOrdered) else part for part in parts]
    assert not tiles_fit(blocks)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="multiple of 16 rows"):  # the tiles refuse them if asked directly
        QuantLinear(amx, blocks, bias=None, out_dtype=torch.float32).on_tiles(x)  # type: ignore[arg-type]


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_units_with_infinite_nan_or_extreme_scales_keep_the_bits(amx: NativeKernels, fmt: str) -> None:
    """Scales of any finite fp16 (subnormals, zeros, 65504), and a few +-inf and NaN scales as a hostile file
    may hold: a unit with one takes the lane-by-lane rounding instead of VCVTNE2PS2BF16, and its finite
    columns must still land where the packer puts them. Repacked (Q4_0, Q4_1, Q8_0) and unpacked formats."""
    generator = torch.Generator().manual_seed(12)
    weight = random_weight(fmt, 48, K, generator, wide=True)
    blocks = weight.data.view(-1, weight.fmt.block_bytes)
    scale = SCALE_FIELDS[fmt][0]  # the block's (first) fp16 scale
    for value, every in ((0x7C00, 7), (0xFC00, 11), (0x7E00, 13)):  # +inf, -inf, NaN: in some units
        blocks[::every, scale : scale + 2] = torch.tensor([value & 0xFF, value >> 8], dtype=torch.uint8)
    stored, reference = _pair(amx, [weight], torch.float32)
    assert stored.quant_tiles is not None
    x = torch.randn(21, K, generator=generator).bfloat16()
    assert torch.equal(bits(stored(x)), bits(reference(x)))


@pytest.fixture(scope="module")
def truncating_build(amx: NativeKernels, build_dir: Path) -> NativeKernels:
    """The negative control: dequantised values cut to bf16, not rounded (a test-only -D build)."""
    return load(build(("-march=native", "-DDETINF_TEST_TILES_TRUNCATE"), build_dir))


def test_negative_control_values_cut_to_bf16_are_caught(
    amx: NativeKernels, truncating_build: NativeKernels
) -> None:
    parts = _parts("Q4_1", (48, 16), K, 3)
    stored, _ = _pair(truncating_build, parts, torch.float32)
    _, reference = _pair(amx, parts, torch.float32)
    assert stored.quant_tiles is not None
    x = torch.randn(37, K, generator=torch.Generator().manual_seed(10)).bfloat16()
    assert not torch.equal(bits(stored(x)), bits(reference(x)))


def test_a_build_without_amx_bf16_refuses_the_tiles() -> None:
    """The AVX2 build (-march=x86-64-v3) has no tile path: the quantized GEMM on the tiles raises, naming
    what is missing, instead of computing something else."""
    lib = load(build(("-march=x86-64-v3",)))
    weight = random_weight("Q4_0", 32, K, torch.Generator().manual_seed(11))
    linear = QuantLinear(lib, [weight], bias=None, out_dtype=torch.float32)
    with pytest.raises(RuntimeError, match="native numerics.*AMX-BF16"):
        linear.on_tiles(torch.ones(2, K, dtype=torch.bfloat16))


def _chunk_tiles(
    kernels: NativeKernels, linear: QuantLinear, first: int, u0: int, count: int
) -> torch.Tensor:
    """part_bf16_tiles of the linear's first part (16 columns from `first`, units [u0, u0 + count)) as int16
    [count * 512]: the tiles the AMX GEMM would multiply, made without AMX (AVX-512 VBMI is enough)."""
    library = kernels.library
    scratch = torch.zeros(library.qpanel_bytes() + 64, dtype=torch.uint8)
    panel = _QPanel()
    library.qpanel_layout(ctypes.c_void_p((scratch.data_ptr() + 63) // 64 * 64), ctypes.byref(panel))
    tiles = torch.zeros(count * 512, dtype=torch.int16)
    units = ctypes.c_int64(linear.in_features // 32)
    library.part_bf16_tiles(
        ctypes.byref(linear.table[0]), ctypes.c_int64(first), units, ctypes.c_int64(u0),
        ctypes.c_int64(count), ctypes.byref(panel), ctypes.c_void_p(tiles.data_ptr()),
    )
    return tiles


class _QPanel(ctypes.Structure):
    """Mirror of csrc/quant.h's qpanel (one chunk's scratch)."""

    _fields_ = [(name, ctypes.c_void_p) for name in ("w", "d", "m", "sc", "mn")]


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("k", [1280, 1312, 576], ids=["even-blocks", "odd-blocks", "short"])
def test_repacked_panels_give_the_tiles_of_the_stored_blocks(
    kernels: NativeKernels, fmt: str, k: int
) -> None:
    """The tiles read straight from a repacked panel (quant_repack.c's pair layout) are those of the blocks as
    stored, on every build with the tile code (AVX-512 VBMI), AMX or not; one damaged byte shows (negative
    control)."""
    if not hasattr(kernels.library, "part_bf16_tiles") or not kernels.library.detinf_quant_repacks(2):
        pytest.skip("this build has no tile code or does not repack (no AVX-512 VBMI / VNNI)")
    weight = random_weight(fmt, 48, k, torch.Generator().manual_seed(k))
    repacked = QuantLinear(kernels, [weight], bias=None, out_dtype=torch.float32)
    stored = QuantLinear(kernels, [weight], bias=None, out_dtype=torch.float32, repack=False)
    assert (repacked.repacked_parts, stored.repacked_parts) == (1, 0)
    units = k // 32
    for first in (0, 16, 32):
        for u0 in range(0, units, 16):  # one chunk of the scratch at a time
            count = min(16, units - u0)
            expected = _chunk_tiles(kernels, stored, first, u0, count)
            assert torch.equal(_chunk_tiles(kernels, repacked, first, u0, count), expected), (first, u0)
    repacked._repacked[0].view(-1)[-1] ^= 0x10  # the last block's last quant byte, last panel's column 15
    last = units - 1
    damaged = _chunk_tiles(kernels, repacked, 32, last, 1)
    assert not torch.equal(damaged, _chunk_tiles(kernels, stored, 32, last, 1))
