"""The attention kernel's tiles (ops/csrc/attention_tile.c): how many query tokens of a sequence are computed
together against each loaded key/value block changes speed, never bits. Every tile size, thread count and
row range gives the bits of one-token tiles (each row computed alone, the order of the kernel before tiles
existed); the comparison sees a one-ulp change of the scale (negative control)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deterministic_inference.ops.attention import AttentionMetadata, new_kv_cache, sequence_kv, write_kv
from deterministic_inference.ops.native import NativeKernels
from tests.ops.helpers import THREADS, bits, num_threads
from tests.ops.test_native import DTYPES, LENGTHS, Case, call_kernel, make_case, run_kernel

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


def in_blocks_of_8(case: Case) -> Case:
    """The case's queries, keys and values in a cache of 8-slot blocks (the kernel's generic path, which
    for a bf16 cache is attention_pairs.c's scalar detinf_pair_row), the sequences in consecutive blocks."""
    kv_heads, head_dim = case.k_cache.shape[1], case.k_cache.shape[2]
    per_seq = [-(-length // 8) for length in LENGTHS]
    k_cache, v_cache = new_kv_cache(sum(per_seq), 8, kv_heads, head_dim, case.k_cache.dtype)
    starts = [sum(per_seq[:i]) for i in range(len(per_seq))]
    tables = tuple(tuple(range(start, start + count)) for start, count in zip(starts, per_seq, strict=True))
    meta = AttentionMetadata.build([(0, n, t) for n, t in zip(LENGTHS, tables, strict=True)], 8)
    lengths = zip(case.tables, LENGTHS, strict=True)
    pieces = [sequence_kv(case.k_cache, case.v_cache, table, n) for table, n in lengths]
    k = torch.cat([keys.transpose(0, 1) for keys, _ in pieces])  # [T, KVH, D]
    v = torch.cat([values.transpose(0, 1) for _, values in pieces])
    write_kv(k_cache, v_cache, k.to(k_cache.dtype), v.to(v_cache.dtype), meta)
    return Case(case.q, k_cache, v_cache, meta, tables, case.scale)


@pytest.mark.parametrize("head_shape", ["smollm2", "tiny", "mqa16"])
def test_bf16_tiles_give_the_bits_of_the_generic_path(kernels: NativeKernels, head_shape: str) -> None:
    """A bf16 cache's pair arithmetic is written twice, vectorised for 16-slot blocks (attention_tile.c)
    and scalar for any block (detinf_pair_row): both give the same bits for the same rows."""
    case = make_case(torch.bfloat16, head_shape, 16, seed=5)
    with num_threads(2):
        assert torch.equal(bits(run_kernel(kernels, case)), bits(run_kernel(kernels, in_blocks_of_8(case))))


def test_negative_control_the_generic_path_comparison_sees_a_one_ulp_scale(kernels: NativeKernels) -> None:
    case = make_case(torch.bfloat16, "smollm2", 16, seed=5)
    nudged = torch.nextafter(torch.tensor(case.scale), torch.tensor(1.0)).item()
    generic = in_blocks_of_8(dataclasses.replace(case, scale=nudged))
    differing = (bits(run_kernel(kernels, case)) != bits(run_kernel(kernels, generic))).flatten(1).any(1)
    assert int(differing.sum()) >= 1  # few rows: weights rounded to bf16 absorb most 1-ulp score changes
