"""The AMX-BF16 GEMM of `--numerics native` (ops/csrc/gemm_amx.h): on this CPU a row's bits do not depend on
the batch's row count, the row's position in it or the thread count; the bias is added once in fp32 and
the bf16 output is the fp32 sum rounded once; the sums are close to the exact ones (it computes the GEMM).
Large calls (x over 1.5 MiB: 97+ rows at K = 8192) take the chunked path (gemm_amx_chunked.h, accumulators
spilled between K chunks) and must give a row the bits it has alone on the small calls' path. Negative
controls: a build sending a call's partial last row tile to the other path, one splitting K by thread
count, and one adding the chunks' sums in fp32, are caught by the same checks. Skipped (with the reason)
where the CPU or OS has no AMX; the refusal of a build without AMX-BF16 is tested everywhere."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deterministic_inference.ops.native import NativeKernels, load
from deterministic_inference.ops.native_build import build
from tests.kernel_builds import build_together
from tests.ops.helpers import HIDDEN, INTER, THREADS, RowFn, bits, num_threads, row_mismatches

NATIVE = ("-march=native",)
# around the 16-row tile: alone, decode sizes, one tile, a tile and a row, two tiles +- 1, many
ROW_COUNTS = (1, 2, 3, 5, 16, 17, 31, 32, 64, 129)
# (N, K): SmolLM2's qkv-like square, gate_up, down; a 1B qkv; ragged N and K (not multiples of 16 / 32)
MODEL_SHAPES = ((HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER), (3072, 2048))
RAGGED_SHAPES = ((200, 65), (130, 2), (48, 33))
# K large enough that a batch of 97+ rows takes the chunked path, a row alone the small one: an odd count
# of blocks (the panel's last pair half empty) and a ragged K (a zero padded last step, chunks of 8 steps)
CHUNKED_SHAPES = ((48, 8192), (40, 4100))
CHUNKED_ROW_COUNTS = (1, 64, 96, 97, 129, 200)
NEGATIVE_DEFINES = {
    "ragged-other": ("-DDETINF_TEST_AMX_RAGGED_OTHER",),
    "split-k": ("-DDETINF_TEST_AMX_SPLIT_K",),
    "chunk-sums": ("-DDETINF_TEST_AMX_CHUNK_SUMS",),
}


@pytest.fixture(scope="module")
def negative_builds(amx: NativeKernels, build_dir: Path) -> dict[str, NativeKernels]:
    """The two negative controls (test-only -D builds of the native kernels), built together."""
    paths = build_together([((*NATIVE, *defines), build_dir) for defines in NEGATIVE_DEFINES.values()])
    return {name: load(path) for name, path in zip(NEGATIVE_DEFINES, paths, strict=True)}


def _weights(shape: tuple[int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A bf16 weight [N, K] scaled like a model's, and an fp32 bias [N]."""
    generator = torch.Generator().manual_seed(seed)
    n, k = shape
    weight = (torch.randn(n, k, generator=generator) / k**0.5).bfloat16()
    return weight, torch.randn(n, generator=generator)


def _native_fn(
    lib: NativeKernels, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype
) -> RowFn:
    packed = lib.pack_bf16(weight)
    return lambda x: lib.gemm_bf16(x, packed, weight.shape[0], bias, out_dtype, native=True)


def _probe_rows(k: int, seed: int) -> torch.Tensor:
    """Three probe rows [3, K] bf16."""
    return torch.randn(3, k, generator=torch.Generator().manual_seed(seed)).bfloat16()


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize(
    ("shape", "row_counts"),
    [(shape, ROW_COUNTS) for shape in MODEL_SHAPES + RAGGED_SHAPES]
    + [(shape, CHUNKED_ROW_COUNTS) for shape in CHUNKED_SHAPES],  # batches of 97+ rows: the chunked path
    ids=str,
)
def test_a_row_alone_equals_the_row_in_any_batch(
    amx: NativeKernels, shape: tuple[int, int], row_counts: tuple[int, ...], threads: int
) -> None:
    weight, bias = _weights(shape, 1)
    fn = _native_fn(amx, weight, bias, torch.float32)
    assert row_mismatches(fn, _probe_rows(shape[1], 2), threads, row_counts) == []


@pytest.mark.parametrize("shape", MODEL_SHAPES[1:3], ids=["gate_up", "down"])
def test_bf16_output_rows_are_invariant_too(amx: NativeKernels, shape: tuple[int, int]) -> None:
    weight, bias = _weights(shape, 3)
    fn = _native_fn(amx, weight, bias, torch.bfloat16)
    assert row_mismatches(fn, _probe_rows(shape[1], 4), 2, ROW_COUNTS) == []


@pytest.mark.parametrize("shape", MODEL_SHAPES + RAGGED_SHAPES + CHUNKED_SHAPES, ids=str)
def test_one_and_two_threads_give_the_same_bits(amx: NativeKernels, shape: tuple[int, int]) -> None:
    weight, bias = _weights(shape, 5)
    fn = _native_fn(amx, weight, bias, torch.float32)
    x = torch.randn(129, shape[1], generator=torch.Generator().manual_seed(6)).bfloat16()
    with num_threads(1):
        one = bits(fn(x))
    with num_threads(2):
        two = bits(fn(x))
    assert torch.equal(one, two)


def test_bias_is_added_once_in_fp32_and_bf16_rounds_once(amx: NativeKernels) -> None:
    weight, bias = _weights((2 * INTER, HIDDEN), 7)
    x = torch.randn(37, HIDDEN, generator=torch.Generator().manual_seed(8)).bfloat16()
    sums = _native_fn(amx, weight, None, torch.float32)(x)
    with_bias = _native_fn(amx, weight, bias, torch.float32)(x)
    rounded = _native_fn(amx, weight, bias, torch.bfloat16)(x)
    assert torch.equal(bits(with_bias), bits(sums + bias))
    assert torch.equal(bits(rounded), bits(with_bias.bfloat16()))


@pytest.mark.parametrize("shape", MODEL_SHAPES + RAGGED_SHAPES, ids=str)
def test_sums_are_close_to_the_exact_product(amx: NativeKernels, shape: tuple[int, int]) -> None:
    """Not bits: TDPBF16PS rounds its own way. Within fp32 accumulation error of the float64 product, and
    equal to the portable path's to a few ulps of the sum of magnitudes (it computes this GEMM)."""
    weight, _ = _weights(shape, 9)
    x = torch.randn(40, shape[1], generator=torch.Generator().manual_seed(10)).bfloat16()
    amx_out = _native_fn(amx, weight, None, torch.float32)(x).double()
    exact = x.double() @ weight.double().T
    magnitude = x.double().abs() @ weight.double().abs().T
    bound = magnitude * shape[1] * 2.0**-23 + 1e-30
    assert bool(((amx_out - exact).abs() <= bound).all())
    portable = amx.gemm_bf16(x, amx.pack_bf16(weight), shape[0], None, torch.float32).double()
    assert bool(((amx_out - portable).abs() <= 2 * bound).all())
    assert (amx_out - exact).abs().max().item() < 1e-3  # and small in absolute terms at these scales


def test_negative_control_a_different_path_for_a_partial_tile_is_caught(
    negative_builds: dict[str, NativeKernels],
) -> None:
    weight, bias = _weights((HIDDEN, INTER), 11)
    fn = _native_fn(negative_builds["ragged-other"], weight, bias, torch.float32)
    found = row_mismatches(fn, _probe_rows(INTER, 12), 1, ROW_COUNTS)
    assert any(f"M={m} " in text for m in (16, 32, 64) for text in found), found


def test_negative_control_k_split_by_thread_count_is_caught(
    negative_builds: dict[str, NativeKernels],
) -> None:
    weight, bias = _weights((HIDDEN, INTER), 13)
    fn = _native_fn(negative_builds["split-k"], weight, bias, torch.float32)
    x = torch.randn(33, INTER, generator=torch.Generator().manual_seed(14)).bfloat16()
    with num_threads(1):
        one = bits(fn(x))
    with num_threads(2):
        two = bits(fn(x))
    assert not torch.equal(one, two)


def test_negative_control_chunk_sums_added_in_fp32_are_caught(
    negative_builds: dict[str, NativeKernels],
) -> None:
    """Chunks that each start from zero (K split by chunk) give a row in a large batch other bits than the
    row alone: the chunked-path test can fail."""
    weight, bias = _weights(CHUNKED_SHAPES[0], 18)
    fn = _native_fn(negative_builds["chunk-sums"], weight, bias, torch.float32)
    found = row_mismatches(fn, _probe_rows(CHUNKED_SHAPES[0][1], 19), 1, CHUNKED_ROW_COUNTS)
    assert found and all(int(text.split()[0][2:]) > 96 for text in found), found


def test_a_build_without_amx_bf16_refuses_native_numerics() -> None:
    """The AVX2 build (the package's -march=x86-64-v3) has no tile path: it says so, and the call raises
    instead of computing something else."""
    lib = load(build(("-march=x86-64-v3",)))
    missing = lib.native_gemm_missing()
    assert missing is not None and "AMX-BF16" in missing
    weight, _ = _weights((48, 64), 15)
    with pytest.raises(RuntimeError, match="native numerics.*AMX-BF16"):
        _native_fn(lib, weight, None, torch.float32)(torch.ones(2, 64, dtype=torch.bfloat16))
