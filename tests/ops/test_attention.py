"""Attention: a query row's bits are the same in a whole-sequence prefill, in chunks of 7/16/64, as a one-row
decode alone, and decoded or prefilled in one step with other sequences of other lengths."""

from __future__ import annotations

import pytest
import torch

from deterministic_inference.ops.attention import (
    AttentionMetadata,
    new_kv_cache,
    paged_attention,
    sequence_kv,
    write_kv,
)
from deterministic_inference.ops.native import native_kernels
from deterministic_inference.ops.selfcheck import AttentionWorld
from tests.ops.helpers import (
    DTYPES,
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    THREADS,
    TINY_HEAD_DIM,
    TINY_HEADS,
    TINY_KV_HEADS,
    bits,
    num_threads,
)

LENGTH = 100  # the probed sequence: crosses cache blocks of 16 and 8
OTHERS = [171, 37, 5]  # other sequences' lengths (longer and shorter)
DECODE_POSITIONS = [0, 1, 15, 16, 31, 32, 33, 47, 63, 64, 65, 80, 98, 99]
HEAD_SHAPES = {"smollm2": (HEADS, KV_HEADS, HEAD_DIM), "tiny": (TINY_HEADS, TINY_KV_HEADS, TINY_HEAD_DIM)}
Items = list[tuple[int, int, int]]  # (sequence, start position, query tokens) of one step


def make_world(
    head_shape: str,
    dtype: torch.dtype,
    seed: int = 0,
    block_size: int = 16,
    window: int = 0,
    softcap: float = 0.0,
) -> AttentionWorld:
    generator = torch.Generator().manual_seed(seed)
    shape = HEAD_SHAPES[head_shape]
    return AttentionWorld(shape, dtype, [LENGTH, *OTHERS], generator, block_size, window, softcap)


def plans() -> dict[str, list[Items]]:
    """Ways to compute sequence 0's rows; each plan is a list of steps."""
    result: dict[str, list[Items]] = {}
    for size in (3, 7, 16, 64):  # 3: chunks that cut the kernel's 4-token tiles
        result[f"chunks{size}"] = [[(0, s, min(size, LENGTH - s))] for s in range(0, LENGTH, size)]
    result["decode"] = [[(0, p, 1)] for p in DECODE_POSITIONS]
    result["decode_grouped"] = [
        [(1, OTHERS[0] - 1 - p % 3, 1), (0, p, 1), (3, OTHERS[2] - 1, 1), (2, p % OTHERS[1], 1)]
        for p in DECODE_POSITIONS
    ]
    result["prefill_grouped"] = [[(1, OTHERS[0] - LENGTH, LENGTH), (0, 0, LENGTH), (3, 0, 5)]]
    result["chunk16_grouped"] = [[(0, s, 16), (1, s + 50, 16), (2, 30, 1)] for s in range(0, LENGTH - 16, 16)]
    return result


def mismatches(world: AttentionWorld, invariant: bool, threads: int) -> list[str]:
    """Rows of every plan compared with a whole-sequence prefill computed with one thread."""
    with num_threads(1):
        reference = world.run([(0, 0, LENGTH)], invariant)
    found = []
    with num_threads(threads):
        for name, plan in plans().items():
            for items in plan:
                for (seq, position), row in world.run(items, invariant).items():
                    if seq == 0 and not torch.equal(bits(row), bits(reference[(0, position)])):
                        found.append(f"{name}@{position}")
    return found


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_shape", list(HEAD_SHAPES))
def test_rows_equal_across_prefill_chunks_decode_and_groups(
    head_shape: str, dtype: torch.dtype, threads: int
) -> None:
    assert mismatches(make_world(head_shape, dtype), True, threads) == []


def test_block_size_8_is_invariant_too() -> None:
    """Blocks other than 16 keys take the kernel's generic loops; still invariant."""
    assert mismatches(make_world("smollm2", torch.bfloat16, seed=1, block_size=8), True, threads=2) == []


def test_negative_control_plain_attention_differs() -> None:
    """Per-sequence SDPA (batch_invariant=False) gives prefill rows other bits than chunks or decode."""
    for dtype in DTYPES:
        assert mismatches(make_world("smollm2", dtype), False, threads=1) != [], dtype


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_invariant_attention_matches_sdpa(dtype: torch.dtype) -> None:
    world = make_world("smollm2", dtype)
    items: Items = [(1, 0, 40), (0, 60, 40), (2, 36, 1)]
    fast = world.run(items, True)
    plain = world.run(items, False)
    for key in fast:
        torch.testing.assert_close(
            fast[key].float(), plain[key].float(), rtol=1e-2, atol=1e-5 if dtype == torch.float32 else 1e-2
        )


def test_cache_layout_round_trips() -> None:
    """Keys written by write_kv (transposed per block) read back by sequence_kv equal what was written."""
    k_cache, v_cache = new_kv_cache(5, 16, TINY_KV_HEADS, TINY_HEAD_DIM, torch.float32)
    keys, values = torch.randn(2, 37, TINY_KV_HEADS, TINY_HEAD_DIM)  # [37, KVH, D] each
    table = [4, 0, 2]
    write_kv(k_cache, v_cache, keys, values, AttentionMetadata.build([(0, 37, table)], 16))
    read_keys, read_values = sequence_kv(k_cache, v_cache, table, 37)  # [KVH, 37, D]
    assert torch.equal(bits(read_keys), bits(keys.transpose(0, 1)))
    assert torch.equal(bits(read_values), bits(values.transpose(0, 1)))
    assert torch.equal(bits(k_cache[4, :, :, 3]), bits(keys[3]))  # key 3 is column 3 of block 4


def test_metadata_rows_follow_the_step_order() -> None:
    meta = AttentionMetadata.build([(5, 2, [7]), (0, 1, [3, 4]), (16, 3, [1, 2])], block_size=16)
    assert meta.num_tokens == 6
    assert meta.row_keys.tolist() == [6, 7, 1, 17, 18, 19]
    assert meta.block_ids.tolist() == [7, 3, 1, 2]  # only the blocks each sequence's keys need
    assert meta.row_table.tolist() == [0, 0, 1, 2, 2, 2]
    assert meta.write_blocks.tolist() == [7, 7, 3, 2, 2, 2]
    assert meta.write_offsets.tolist() == [5, 6, 0, 0, 1, 2]
    assert [(s.first_row, s.num_rows) for s in meta.sequences] == [(0, 2), (2, 1), (3, 3)]


def test_metadata_for_another_cache_is_refused() -> None:
    world = make_world("tiny", torch.float32)
    meta = AttentionMetadata.build([(0, 1, [world.k_cache.shape[0]])], block_size=16)
    q = torch.zeros(1, TINY_HEADS, TINY_HEAD_DIM)
    with pytest.raises(ValueError, match="does not fit a cache"):
        paged_attention(q, world.k_cache, world.v_cache, meta, scale=1.0, kernels=native_kernels())


# Sliding windows: 1 key; a block exactly; 24 and 37 keys, whose start moves through the blocks
WINDOWS = [1, 16, 24, 37]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_shape", list(HEAD_SHAPES))
def test_window_rows_equal_across_prefill_chunks_decode_and_groups(
    head_shape: str, dtype: torch.dtype, window: int
) -> None:
    """A windowed row's bits do not depend on the chunk, the step's other rows or the block its window
    starts in (every plan's windows cross chunk and block boundaries), nor on 1 vs 2 threads."""
    assert mismatches(make_world(head_shape, dtype, window=window), True, threads=2) == []


def test_window_block_size_8_is_invariant_too() -> None:
    world = make_world("smollm2", torch.bfloat16, seed=1, block_size=8, window=24)
    assert mismatches(world, True, threads=2) == []


def test_negative_control_plain_windowed_attention_differs() -> None:
    assert mismatches(make_world("smollm2", torch.float32, window=24), False, threads=1) != []


@pytest.mark.parametrize("window", WINDOWS)
def test_window_rows_attend_exactly_their_window(window: int) -> None:
    """Against a float64 softmax over keys p - window + 1 .. p of each position p."""
    world = make_world("tiny", torch.float32, window=window)
    rows = world.run([(0, 0, LENGTH)], True)
    keys, values = sequence_kv(world.k_cache, world.v_cache, world.tables[0], LENGTH)  # [KVH, L, D]
    group = TINY_HEADS // TINY_KV_HEADS
    keys, values = (t.double().repeat_interleave(group, 0) for t in (keys, values))  # [H, L, D]
    for p in range(LENGTH):
        first = max(0, p - window + 1)
        q = world.queries[0][p].double()  # [H, D]
        scores = torch.einsum("hd,hld->hl", q, keys[:, first : p + 1]) * TINY_HEAD_DIM**-0.5
        expected = torch.einsum("hl,hld->hd", scores.softmax(-1), values[:, first : p + 1])
        torch.testing.assert_close(rows[(0, p)].double(), expected, rtol=1e-5, atol=1e-6)


def test_window_wider_than_the_sequence_is_full_attention_bit_for_bit() -> None:
    """Rows whose window reaches key 0 take the unwindowed kernel's path and bits; a wider window too."""
    full = make_world("smollm2", torch.bfloat16).run([(0, 0, LENGTH)], True)
    for window in (LENGTH, 1000):
        windowed = make_world("smollm2", torch.bfloat16, window=window).run([(0, 0, LENGTH)], True)
        assert all(torch.equal(bits(windowed[key]), bits(full[key])) for key in full)
    cut = make_world("smollm2", torch.bfloat16, window=24).run([(0, 0, LENGTH)], True)
    assert all(torch.equal(bits(cut[(0, p)]), bits(full[(0, p)])) for p in range(24))
    assert not any(torch.equal(bits(cut[(0, p)]), bits(full[(0, p)])) for p in range(24, LENGTH))


@pytest.mark.parametrize("window", [0, 24])
def test_soft_capped_rows_are_invariant_and_capped(window: int) -> None:
    """Gemma 2: scores -> tanh(s / c) * c before the softmax; rows equal across every plan, and equal a
    float64 reference over their window."""
    world = make_world("tiny", torch.float32, window=window, softcap=2.0)
    assert mismatches(world, True, threads=2) == []
    rows = world.run([(0, 0, LENGTH)], True)
    keys, values = sequence_kv(world.k_cache, world.v_cache, world.tables[0], LENGTH)  # [KVH, L, D]
    group = TINY_HEADS // TINY_KV_HEADS
    keys, values = (t.double().repeat_interleave(group, 0) for t in (keys, values))  # [H, L, D]
    for p in range(LENGTH):
        first = max(0, p - window + 1) if window else 0
        q = world.queries[0][p].double()  # [H, D]
        scores = torch.einsum("hd,hld->hl", q, keys[:, first : p + 1]) * TINY_HEAD_DIM**-0.5
        scores = torch.tanh(scores / 2.0) * 2.0
        expected = torch.einsum("hl,hld->hd", scores.softmax(-1), values[:, first : p + 1])
        torch.testing.assert_close(rows[(0, p)].double(), expected, rtol=1e-5, atol=1e-6)
    plain = make_world("tiny", torch.float32, window=window, softcap=2.0).run([(0, 0, LENGTH)], False)
    torch.testing.assert_close(plain[(0, LENGTH - 1)], rows[(0, LENGTH - 1)], rtol=1e-5, atol=1e-6)
