"""The attention kernel over a q8_0 KV cache (csrc/kv_q8.h read by attention.c / attention_tile.c): every
row's bits are those of the reference sequence (each cached value dequantized as ONE fp32 multiply q *
scale, then the fp32 kernel's fixed order), whatever the row count, the row's position and range, the tile
size, the thread count or the -march of the build; a one-ulp change of the scales is seen."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deterministic_inference.ops.kv_format import dequantize_q8_0, q8_views
from deterministic_inference.ops.native import NativeKernels
from tests.ops.helpers import THREADS, bits, num_threads
from tests.ops.test_attention_tiles import tile_mismatches
from tests.ops.test_native import (
    BLOCK_SIZES,
    Q8_HEAD_SHAPES,
    X86,
    Case,
    call_kernel,
    make_case,
    reference_attention,
    run_kernel,
)

Q8 = torch.int8


def dequantized(case: Case, nudge_scales: bool = False) -> Case:
    """The case with its q8_0 cache replaced by the fp32 values the kernel must compute with: q * scale in
    torch, one fp32 multiply each (`nudge_scales`: every scale one fp32 ulp up first: a negative control)."""
    views = q8_views(case.k_cache, case.v_cache)
    key_scales, value_scales = views.key_scales, views.value_scales
    if nudge_scales:
        key_scales = torch.nextafter(key_scales, torch.tensor(float("inf")))
        value_scales = torch.nextafter(value_scales, torch.tensor(float("inf")))
    keys = dequantize_q8_0(views.key_values, key_scales, axis=2).contiguous()  # [blocks, KVH, D, block]
    values = dequantize_q8_0(views.value_values, value_scales, axis=3).contiguous()  # [blocks, KVH, block, D]
    return dataclasses.replace(case, k_cache=keys, v_cache=values)


@pytest.mark.parametrize("block", BLOCK_SIZES)
@pytest.mark.parametrize("head_shape", list(Q8_HEAD_SHAPES))
def test_q8_rows_equal_the_reference_sequence_bitwise(
    kernels: NativeKernels, head_shape: str, block: int
) -> None:
    """Block 16 (the tile path) and 8 (the generic loops): the q8_0 kernel's rows equal, bit for bit, the fp32
    kernel over the torch-dequantized cache; unused slots (NaN scales) never reach a row."""
    case = make_case(Q8, head_shape, block)
    got = run_kernel(kernels, case)
    assert bool(got.isfinite().all())
    assert torch.equal(bits(got), bits(run_kernel(kernels, dequantized(case))))


def test_negative_control_a_one_ulp_change_of_the_scales_is_seen(kernels: NativeKernels) -> None:
    case = make_case(Q8, "smollm2", 16)
    differing = bits(run_kernel(kernels, case)) != bits(run_kernel(kernels, dequantized(case, True)))
    assert int(differing.flatten(1).any(1).sum()) > case.q.shape[0] // 2


@pytest.mark.parametrize("block", BLOCK_SIZES)
def test_q8_attention_matches_float64_reference(kernels: NativeKernels, block: int) -> None:
    """Against float64 attention over the same dequantized cache: the kernel's own rounding only."""
    case = make_case(Q8, "smollm2", block)
    error = (run_kernel(kernels, case).double() - reference_attention(case)).abs().max().item()
    assert error < 1e-5, f"max abs error {error:.3g}"


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("head_shape", list(Q8_HEAD_SHAPES))
def test_every_tile_size_and_thread_count_gives_the_bits_of_rows_alone(
    kernels: NativeKernels, head_shape: str, threads: int
) -> None:
    """Sequences of 1, 15, 16, 17 and 100 tokens: tiles of 1..8 tokens, 1 or 2 threads, against one-token
    tiles on one thread."""
    case = make_case(Q8, head_shape, 16, seed=3)
    assert tile_mismatches(kernels, case, threads) == []


@pytest.mark.parametrize("block", BLOCK_SIZES)
@pytest.mark.parametrize("size", [1, 3, 13])
def test_row_ranges_give_the_same_bits(kernels: NativeKernels, size: int, block: int) -> None:
    """Calls over consecutive row ranges of `size` rows (a chunked prefill; 1: every row alone, a decode
    step) equal one call over all rows, with 2 threads."""
    case = make_case(Q8, "smollm2", block, seed=4)
    with num_threads(1):
        expected = bits(run_kernel(kernels, case))
    total = case.q.shape[0]
    out = torch.full(case.q.shape, float("nan"))
    with num_threads(2):
        for first in range(0, total, size):
            call_kernel(kernels, case, out, rows=(first, min(first + size, total)))
    assert torch.equal(bits(out), expected)


@pytest.mark.skipif(not X86, reason="the alternative builds use x86-64 -march levels")
@pytest.mark.parametrize("block", BLOCK_SIZES)
def test_isa_flags_do_not_change_q8_bits(
    kernels: NativeKernels, march_builds: dict[str, NativeKernels], block: int
) -> None:
    case = make_case(Q8, "smollm2", block)
    expected = bits(run_kernel(kernels, case))
    for name, other in march_builds.items():
        assert torch.equal(bits(run_kernel(other, case)), expected), name


def test_q8_cache_with_a_head_dim_not_a_multiple_of_32_is_refused(kernels: NativeKernels) -> None:
    case = make_case(Q8, "smollm2", 16)
    cut = dataclasses.replace(case, k_cache=case.k_cache[:, :, :-9].contiguous())
    with pytest.raises(ValueError, match="KV cache"):
        run_kernel(kernels, cut)
