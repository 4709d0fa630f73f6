"""`--numerics native` on quantized weights read in place (ops/csrc/quant_tiles.c, gemm_amx.h): each panel of
blocks is dequantised into AMX-BF16 tiles as the GEMM reaches it. Its bits must be those of the AMX-BF16 GEMM
on the weight dequantised to bf16 at load (exactly, as gguf does) and packed, for every block format, for
stacked parts read repacked or as stored (a part of 40 rows; Q5_0 / Q5_1, never repacked), through a row
order, on the small calls' path and the chunked one (200 rows at K = 4096), at 1 and 2 threads; and a
row's bits must not depend on the batch. A linear whose parts would split a 16-column block is dequantised
at load instead, with the same bits. Negative control: a build cutting each dequantised value to bf16 instead
of rounding it is caught. Skipped where the CPU or OS has no AMX-BF16; a build without the tiles refusing
the call is tested everywhere."""

from __future__ import annotations

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
