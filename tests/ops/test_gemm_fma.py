"""The bf16 GEMM's FMA path (ops/csrc/gemm_fma.h): every element is gemm.c's documented sum, at every row
count around its 8-row and 4-row tiles, at any row position, with 1 and 2 threads, and the FMA, VDPBF16PS
and portable builds agree bit for bit. Negative controls: a build adding the even element first, and one
without flush-to-zero, are caught. Skipped where the CPU has no AVX-512 (the path is not built there)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deterministic_inference.ops.native import NativeKernels, load
from tests.kernel_builds import build_together
from tests.ops.helpers import HIDDEN, INTER, THREADS, bits, num_threads, row_mismatches
from tests.ops.test_native_gemm import _wide, documented_order

NATIVE = ("-march=native",)
ROW_COUNTS = (1, 2, 3, 4, 5, 7, 8, 9, 12, 15, 16, 17, 24, 31, 32, 33)  # around the 8- and 4-row tiles
# (n, k): one block, 3 blocks of a panel, a panel and a ragged block, odd k, k of one pair
COLUMN_SHAPES = ((16, 64), (48, 33), (80, 130), (130, 2), (200, 65))


# The test-only builds of this file: the defines gemm.c reads (the FMA path forced, or perturbed).
FMA_DEFINES = {
    "fma": ("-DDETINF_TEST_FORCE_FMA_GEMM",),
    "no-fma": ("-DDETINF_TEST_NO_FMA_GEMM",),
    "no-ftz": ("-DDETINF_TEST_FORCE_FMA_GEMM", "-DDETINF_TEST_FMA_NO_FTZ"),
    "even-first": ("-DDETINF_TEST_FORCE_FMA_GEMM", "-DDETINF_TEST_FMA_EVEN_FIRST"),
}


@pytest.fixture(scope="module")
def fma_builds(build_dir: Path) -> dict[str, NativeKernels]:
    """This file's four test-only builds, compiled together (tests/kernel_builds.py) into the session's
    directory: the FMA path forced (also where the default build would take VDPBF16PS, on AMD), this CPU's
    build without it, and the two negative controls."""
    paths = build_together([((*NATIVE, *defines), build_dir) for defines in FMA_DEFINES.values()])
    return {name: load(path) for name, path in zip(FMA_DEFINES, paths, strict=True)}


@pytest.fixture(scope="module")
def fma(fma_builds: dict[str, NativeKernels]) -> NativeKernels:
    """The FMA path; the file skips where the CPU has no AVX-512 (the path is not built there)."""
    lib = fma_builds["fma"]
    if lib.gemm_bf16_path() != "fma":
        pytest.skip("no AVX-512 here: the FMA path is not built")
    return lib


@pytest.fixture(scope="module")
def others(
    fma_builds: dict[str, NativeKernels], march_builds: dict[str, NativeKernels]
) -> dict[str, NativeKernels]:
    """The other paths: this CPU's build without the FMA path, and the portable (AVX2) build (the package's
    own -march=x86-64-v3 build, shared with the other kernel tests)."""
    return {"no-fma": fma_builds["no-fma"], "portable": march_builds["x86-64-v3"]}


def _gemm(
    lib: NativeKernels, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    return lib.gemm_bf16(x, lib.pack_bf16(w), w.shape[0], bias, torch.float32)


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("columns", COLUMN_SHAPES, ids=str)
def test_every_element_is_the_documented_sum(
    fma: NativeKernels, columns: tuple[int, int], threads: int
) -> None:
    n, k = columns
    w = _wide((n, k), 2)
    with num_threads(threads):
        for m in ROW_COUNTS:
            x = _wide((m, k), 100 + m)
            assert torch.equal(bits(_gemm(fma, x, w)), bits(documented_order(x, w))), f"M = {m}"


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("shape", [(2 * INTER, HIDDEN), (HIDDEN, INTER)], ids=["gate_up", "down"])
def test_rows_do_not_depend_on_the_batch_or_the_threads(
    fma: NativeKernels, shape: tuple[int, int], threads: int
) -> None:
    """A row alone (one thread) vs at the first, a middle and the last position of batches of 1..64 rows."""
    n, k = shape
    w = (torch.randn(n, k, generator=torch.Generator().manual_seed(8)) / k**0.5).bfloat16()
    packed = fma.pack_bf16(w)

    def rows_fn(x: torch.Tensor) -> torch.Tensor:
        return fma.gemm_bf16(x, packed, n, None, torch.float32)

    probes = torch.randn(2, k, generator=torch.Generator().manual_seed(9)).bfloat16()
    assert row_mismatches(rows_fn, probes, threads) == []


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_builds_agree_at_model_shapes(
    fma: NativeKernels, others: dict[str, NativeKernels], out_dtype: torch.dtype
) -> None:
    generator = torch.Generator().manual_seed(10)
    for n, k in ((2 * INTER, HIDDEN), (HIDDEN, INTER)):
        w = (torch.randn(n, k, generator=generator) / k**0.5).bfloat16()
        x = torch.randn(33, k, generator=generator).bfloat16()
        bias = torch.randn(n, generator=generator)
        expected = bits(fma.gemm_bf16(x, fma.pack_bf16(w), n, bias, out_dtype))
        for name, lib in others.items():
            assert torch.equal(bits(lib.gemm_bf16(x, lib.pack_bf16(w), n, bias, out_dtype)), expected), name


def _tiny_sums() -> tuple[torch.Tensor, torch.Tensor]:
    """Products near 2^-130, so many running sums fall among the fp32 denormals and must be flushed."""
    generator = torch.Generator().manual_seed(11)
    x = (torch.randn(9, 64, generator=generator) * 2.0**-64).bfloat16()
    w = (torch.randn(48, 64, generator=generator) * 2.0**-64).bfloat16()
    return x, w


def test_denormal_sums_are_flushed_as_documented(
    fma: NativeKernels, others: dict[str, NativeKernels]
) -> None:
    x, w = _tiny_sums()
    expected = bits(documented_order(x, w))
    assert torch.equal(bits(_gemm(fma, x, w)), expected)
    assert torch.equal(bits(_gemm(others["no-fma"], x, w)), expected)


def test_negative_control_no_flush_to_zero_is_caught(
    fma: NativeKernels, fma_builds: dict[str, NativeKernels]
) -> None:
    """The comparison above can fail: without flush-to-zero the denormal sums survive."""
    no_ftz = fma_builds["no-ftz"]
    x, w = _tiny_sums()
    assert not torch.equal(bits(_gemm(no_ftz, x, w)), bits(documented_order(x, w)))


def test_negative_control_the_even_element_first_is_caught(
    fma: NativeKernels, fma_builds: dict[str, NativeKernels]
) -> None:
    """The element-wise and build comparisons can fail: the FMA path adding each pair's even element first
    differs from the documented sum and from the default build, and equals the even-first replay."""
    even_first = fma_builds["even-first"]
    x, w = _wide((17, 65), 3), _wide((130, 65), 4)
    out = bits(_gemm(even_first, x, w))
    assert not torch.equal(out, bits(documented_order(x, w)))
    assert not torch.equal(out, bits(_gemm(fma, x, w)))
    assert torch.equal(out, bits(documented_order(x, w, odd_first=False)))
