"""The attention kernel's tiles (ops/csrc/attention_tile.c): how many query tokens of a sequence are computed
together against each loaded key/value block changes speed, never bits. Every tile size, thread count and
row range gives the bits of one-token tiles (each row computed alone, the order of the kernel before tiles
existed); the comparison sees a one-ulp change of the scale (negative control)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deterministic_inference.ops.native import NativeKernels
from tests.ops.helpers import THREADS, bits, num_threads
from tests.ops.test_native import DTYPES, Case, call_kernel, make_case, run_kernel

TILES = (0, 2, 3, 4, 5, 8)  # 0: the kernel's own choice (4 tokens for SmolLM2's 3 heads per KV head)


def tile_mismatches(
    kernels: NativeKernels, case: Case, threads: int, scale: float | None = None
) -> list[str]:
    """Rows of every tile size (with `threads` threads, the case's scale or `scale`) whose bits differ from
    one-token tiles computed with one thread."""
    with num_threads(1):
        reference = bits(run_kernel(kernels, case, tile=1))
    probe = case if scale is None else dataclasses.replace(case, scale=scale)
    found: list[str] = []
    with num_threads(threads):
        for tile in TILES:
            differing = (bits(run_kernel(kernels, probe, tile=tile)) != reference).flatten(1).any(1)
            found.extend(f"tile {tile} row {row}" for row in differing.nonzero().flatten().tolist())
    return found


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("head_shape", ["smollm2", "tiny", "mqa16"])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_every_tile_size_gives_the_bits_of_rows_alone(
    kernels: NativeKernels, dtype_name: str, head_shape: str, threads: int
) -> None:
    """Sequences of 1, 15, 16, 17 and 100 tokens (every position a query row), NaN in unused cache slots:
    tiles cut at sequence ends and hold rows whose last blocks differ."""
    case = make_case(DTYPES[dtype_name], head_shape, 16, seed=3)
    assert tile_mismatches(kernels, case, threads) == []


@pytest.mark.parametrize("size", [3, 5, 7, 13])
def test_row_ranges_that_cut_tiles_anywhere_give_the_same_bits(kernels: NativeKernels, size: int) -> None:
    """Calls over consecutive row ranges of `size` rows (a chunked prefill) equal one-token tiles."""
    case = make_case(torch.bfloat16, "smollm2", 16, seed=4)
    expected = bits(run_kernel(kernels, case, tile=1))
    total = case.q.shape[0]
    out = torch.full(case.q.shape, float("nan"))
    with num_threads(2):
        for first in range(0, total, size):
            call_kernel(kernels, case, out, rows=(first, min(first + size, total)))
    assert torch.equal(bits(out), expected)


def test_negative_control_a_one_ulp_change_of_the_scale_is_seen(kernels: NativeKernels) -> None:
    case = make_case(torch.float32, "smollm2", 16, seed=3)
    nudged = torch.nextafter(torch.tensor(case.scale), torch.tensor(1.0)).item()  # next fp32 value
    found = tile_mismatches(kernels, case, threads=1, scale=nudged)
    assert len(found) > case.q.shape[0]  # most rows of every tile size
