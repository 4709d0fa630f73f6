"""The block pool under an all-layer sliding window: exact block ids released behind the window, their
prefix-cache state, prefix hits that skip them, rollback, the admission bound, and the write check."""

from __future__ import annotations

import pytest

from deterministic_inference.engine.admission import check_fits
from deterministic_inference.engine.kv_cache import FREED_BLOCK, KVCacheManager
from deterministic_inference.errors import InvalidRequestError
from deterministic_inference.ops.attention import AttentionMetadata
from tests.engine.test_kv_cache import EXTRA, make, run_prompt


def windowed(num_blocks: int, caching: bool = True, window: int = 6) -> KVCacheManager:
    """Blocks of 4 slots; every layer sees the last `window` keys (a query at q: keys q - 5 .. q)."""
    return KVCacheManager(num_blocks, 4, caching, EXTRA, sliding_window=window)


def test_blocks_behind_the_window_of_the_next_chunk_are_released() -> None:
    kv = windowed(10, caching=False)
    a = make("a", list(range(30)))
    assert kv.allocate(a, 8) and a.block_ids == [0, 1]
    a.num_computed_tokens = 8  # next chunk starts at 8: it sees keys from 3, block 0 still needed
    assert kv.allocate(a, 4) and a.block_ids == [0, 1, 2]
    a.num_computed_tokens = 12  # from 12: keys 7.. -> block 0 (keys 0-3) is released, block 1 kept
    assert kv.allocate(a, 4) and a.block_ids == [FREED_BLOCK, 1, 2, 0]  # block 0 reused at once
    assert kv.num_held_blocks(a) == 3 and kv.num_used_blocks == 3
    a.num_computed_tokens = 16  # keys 11..: block 1 (4-7) goes; block 2 (8-11) stays
    assert kv.allocate(a, 1) and a.block_ids == [FREED_BLOCK, FREED_BLOCK, 2, 0, 1]
    kv.free(a)
    assert kv.free_block_ids() == list(range(10)) and a.block_ids == []


def test_the_window_edge_is_inclusive() -> None:
    """A query at q sees keys q - W + 1 .. q (W 6): at q = 8 key 3 is seen, so block 0 (keys 0-3) stays,
    at q = 9 it goes; block 1 (keys 4-7) stays through q = 12 (key 7) and goes at q = 13."""
    kv = windowed(10, caching=False)
    a = make("a", list(range(30)))
    assert kv.allocate(a, 8)
    steps = ((8, [0, 1, 2]), (9, [-1, 1, 2]), (12, [-1, 1, 2, 0]), (13, [-1, -1, 2, 0]))
    for computed, held in steps:
        a.num_computed_tokens = computed
        assert kv.allocate(a, 1) and a.block_ids == held, computed


def test_released_cached_blocks_stay_hits_and_hits_skip_blocks_behind_the_window() -> None:
    kv = windowed(10)
    a = make("a", list(range(20)))
    run_prompt(kv, a)  # blocks 0-4, all full and cached
    a.num_computed_tokens = 20
    assert kv.allocate(a, 1) and a.block_ids == [-1, -1, -1, 3, 4, 5]  # keys 15..: blocks 0-2 go
    assert kv.num_cached_blocks == 5 and kv.free_block_ids() == [6, 7, 8, 9]  # 0-2: cached, evictable
    assert [kv.ref_count(i) for i in (1, 2, 3)] == [0, 0, 1]
    b = make("b", list(range(18)))  # hits blocks 0-3 (16 tokens): computes from 16, keys 11..
    assert kv.get_computed_prefix(b) == 16
    assert kv.allocate(b, 2)
    assert b.block_ids == [-1, -1, 2, 3, 6] and b.num_computed_tokens == 16  # block 2: keys 8-11
    assert kv.stats.hit_tokens == 16 and [kv.ref_count(i) for i in (1, 2, 3)] == [0, 1, 2]


def test_admission_counts_the_released_blocks() -> None:
    """A pool of 3 blocks carries a sequence of any length when its window and chunk fit."""
    kv = windowed(3, caching=False)
    a = make("a", list(range(100)))
    for start in range(0, 99):
        a.num_computed_tokens = start
        assert kv.allocate(a, 1), start
        assert kv.num_held_blocks(a) <= kv.window_block_limit(1) == 3
    limit = kv.window_block_limit(4)  # ceil((6 - 1 + 4) / 4) + 1
    assert limit == 4
    check_fits(10, 500, 1000, 4, 4, window_blocks=limit)
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        check_fits(10, 500, 1000, 4, 4)
    assert KVCacheManager(3, 4, True, EXTRA).window_block_limit(4) == 0  # no window: no bound


def test_rollback_never_reaches_a_released_block() -> None:
    kv = windowed(10, caching=False)
    a = make("a", list(range(30)))
    assert kv.allocate(a, 20)
    a.num_computed_tokens = 20
    assert kv.allocate(a, 4) and a.block_ids == [-1, -1, -1, 3, 4, 0]
    kv.release_tail(a, 20)  # drafts past token 20 rejected: the tail block goes
    assert a.block_ids == [-1, -1, -1, 3, 4]
    with pytest.raises(RuntimeError, match="released behind the sliding window"):
        kv.release_tail(a, 1)  # a bug in the caller: would cut into released entries


def test_attention_metadata_refuses_writes_to_a_released_block() -> None:
    AttentionMetadata.build([(12, 4, (-1, -1, 2, 3))], 4)  # reads from the window only: fine
    with pytest.raises(ValueError, match="released"):
        AttentionMetadata.build([(4, 4, (-1, -1, 2))], 4)
