"""KV block pool + prefix cache: exact block ids, ref counts, eviction order, hash stability, flush."""

from __future__ import annotations

import subprocess
import sys

from deterministic_inference.engine.kv_cache import ROOT_HASH, KVCacheManager, hash_block
from deterministic_inference.engine.request import Request
from deterministic_inference.engine.sampling_params import SamplingParams

EXTRA = "model=test;numerics=abc"


def make(request_id: str, tokens: list[int], **params: object) -> Request:
    return Request(request_id, tokens, SamplingParams(**params), seed=0)  # type: ignore[arg-type]


def run_prompt(kv: KVCacheManager, request: Request) -> None:
    """Admit a request, 'compute' its whole prompt and register its full blocks, as the scheduler does."""
    cached = kv.get_computed_prefix(request)
    assert kv.allocate(request, request.num_tokens - cached)
    request.num_computed_tokens = request.num_tokens
    kv.commit_full_blocks(request)


def test_allocation_takes_lowest_free_ids_and_free_returns_them() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=False, hash_extra=EXTRA)
    a, b = make("a", list(range(10))), make("b", list(range(5)))
    assert kv.allocate(a, 10) and a.block_ids == [0, 1, 2]
    assert kv.allocate(b, 5) and b.block_ids == [3, 4]
    assert kv.num_free_blocks == 5 and kv.num_used_blocks == 5
    kv.free(a)
    assert a.block_ids == [] and kv.free_block_ids() == [0, 1, 2, 5, 6, 7, 8, 9]
    c = make("c", list(range(6)))
    assert kv.allocate(c, 6) and c.block_ids == [0, 1]
    # Growing an allocation: decode steps add a block only when the last one is full.
    b.num_computed_tokens = 5
    assert kv.allocate(b, 3) and b.block_ids == [3, 4]
    b.num_computed_tokens = 8
    assert kv.allocate(b, 1) and b.block_ids == [3, 4, 2]


def test_failed_allocation_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4, enable_prefix_caching=True, hash_extra=EXTRA)
    a = make("a", list(range(9)))
    run_prompt(kv, a)  # 3 blocks, 2 of them cached
    b = make("b", list(range(8)) + [50, 51, 52])  # would hit 2 blocks but needs a third one
    assert kv.get_computed_prefix(b) == 8
    assert not kv.allocate(b, 3)
    assert b.block_ids == [] and b.num_computed_tokens == 0 and b.num_cached_tokens == 0
    assert [kv.ref_count(i) for i in range(3)] == [1, 1, 1]
    assert kv.stats.queries == 1 and kv.num_free_blocks == 0


def test_prefix_hit_shares_blocks_with_ref_counts() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=True, hash_extra=EXTRA)
    a = make("a", list(range(10)))
    run_prompt(kv, a)
    assert a.block_ids == [0, 1, 2] and kv.num_cached_blocks == 2  # block 2 holds 2 tokens: not full
    b = make("b", list(range(8)) + [77, 78, 79])
    assert kv.get_computed_prefix(b) == 8
    assert kv.allocate(b, 3)
    assert b.block_ids == [0, 1, 3] and b.num_computed_tokens == 8 and b.num_cached_tokens == 8
    assert [kv.ref_count(i) for i in range(4)] == [2, 2, 1, 1]
    assert (kv.stats.hit_tokens, kv.stats.queried_tokens) == (8, 21)
    kv.free(a)
    assert [kv.ref_count(i) for i in range(4)] == [1, 1, 0, 1]
    assert kv.free_block_ids() == [2, 4, 5, 6, 7, 8, 9]  # block 2 was never full: truly free


def test_last_known_token_is_always_recomputed() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=True, hash_extra=EXTRA)
    run_prompt(kv, make("a", list(range(12))))
    assert kv.get_computed_prefix(make("same", list(range(12)))) == 8
    assert kv.get_computed_prefix(make("shorter", list(range(8)))) == 4
    assert kv.get_computed_prefix(make("longer", list(range(13)))) == 12
    assert kv.get_computed_prefix(make("one", [0])) == 0


def test_output_tokens_are_cached_too() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=True, hash_extra=EXTRA)
    a = make("a", [1, 2, 3])
    run_prompt(kv, a)
    a.output_token_ids += [4, 5]  # 5 known tokens, 4 computed after one decode step
    a.num_computed_tokens = 4
    kv.commit_full_blocks(a)
    assert kv.num_cached_blocks == 1
    assert kv.get_computed_prefix(make("b", [1, 2, 3, 4, 9])) == 4


def test_no_hit_for_prompt_logprobs_other_extra_or_disabled_cache() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=True, hash_extra=EXTRA)
    run_prompt(kv, make("a", list(range(9))))
    assert kv.get_computed_prefix(make("b", list(range(9)), prompt_logprobs=0)) == 0
    other = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=True, hash_extra="other")
    run_prompt(other, make("a", list(range(9))))
    assert other.block_hash_of(0) != kv.block_hash_of(0)
    off = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=False, hash_extra=EXTRA)
    run_prompt(off, make("a", list(range(9))))
    assert off.num_cached_blocks == 0 and off.get_computed_prefix(make("b", list(range(9)))) == 0


def test_eviction_order_is_lru_by_logical_release_time_tail_first() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=2, enable_prefix_caching=True, hash_extra=EXTRA)
    a = make("a", [10, 11, 12, 13, 14])  # blocks 0,1 full (cached), 2 partial
    b = make("b", [20, 21, 22, 23, 24])  # blocks 3,4 full (cached), 5 partial
    run_prompt(kv, a)
    run_prompt(kv, b)
    assert (a.block_ids, b.block_ids) == ([0, 1, 2], [3, 4, 5])
    kv.free(a)  # released last block first: 2 (truly free), 1 at t=1, 0 at t=2
    kv.free(b)  # 5 (truly free), 4 at t=4, 3 at t=5
    assert kv.free_block_ids() == [2, 5] and kv.num_free_blocks == 6
    c = make("c", [30, 31, 32, 33, 34, 35])  # needs 3 new blocks, no hit
    assert kv.allocate(c, 6)
    # truly free first (lowest id), then the least recently released: 1 (a's tail, t=1)
    assert c.block_ids == [2, 5, 1]
    assert kv.stats.evictions == 1
    assert kv.get_computed_prefix(make("a2", [10, 11, 12, 13, 14])) == 2  # a's head survives
    assert kv.get_computed_prefix(make("b2", [20, 21, 22, 23, 24])) == 4  # b's chain survives
    d = make("d", [20, 21, 22, 23, 99])
    assert kv.allocate(d, 1)
    assert d.block_ids == [3, 4, 0]  # hits take 3 and 4 back (ref 0 -> 1); 0 (t=2) is evicted
    assert kv.stats.evictions == 2 and kv.num_free_blocks == 0
    assert not kv.allocate(make("e", [1, 2, 3]), 3)  # nothing left to evict
    kv.free(d)  # 0 uncommitted -> truly free; then 4 at t=6, 3 at t=7
    e = make("e", [1, 2, 3])
    assert kv.allocate(e, 3) and e.block_ids == [0, 4]  # stale heap entries of 3 and 4 are skipped
    assert kv.stats.evictions == 3
    assert kv.get_computed_prefix(make("b3", [20, 21, 22, 23, 24])) == 2  # tail 4 gone, head 3 kept


def test_every_non_cached_block_returns_to_the_free_list_and_flush() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True, hash_extra=EXTRA)
    requests = [make("a", list(range(9))), make("b", list(range(6))), make("c", [5, 6, 7])]
    for request in requests:
        run_prompt(kv, request)
    shared = make("d", list(range(8)) + [40])
    run_prompt(kv, shared)
    assert shared.block_ids[:2] == requests[0].block_ids[:2]
    for request in [*requests, shared]:
        kv.free(request)
    cached = [i for i in range(8) if kv.block_hash_of(i) is not None]
    assert cached == [0, 1]
    assert kv.free_block_ids() == [i for i in range(8) if i not in cached]
    assert kv.num_free_blocks == 8 and all(kv.ref_count(i) == 0 for i in range(8))
    held = make("h", list(range(5)))
    run_prompt(kv, held)  # holds cached block 0
    assert kv.flush() == 1  # only block 1: block 0 is held
    assert kv.block_hash_of(0) is not None and kv.block_hash_of(1) is None
    kv.free(held)
    assert kv.flush() == 1 and kv.num_cached_blocks == 0
    assert kv.free_block_ids() == list(range(8))


def test_hash_chain_is_pinned_and_process_independent() -> None:
    code = (
        "from deterministic_inference.engine.kv_cache import ROOT_HASH, hash_block\n"
        "h = hash_block(ROOT_HASH, [1, 2, 3, 4], 'x')\n"
        "print(hash_block(h, [5, 6, 2**40, 0], 'x').hex())\n"
    )
    h = hash_block(ROOT_HASH, [1, 2, 3, 4], "x")
    expected = hash_block(h, [5, 6, 2**40, 0], "x").hex()
    for hash_seed in ("0", "4242"):
        out = subprocess.run(
            [sys.executable, "-c", code],
            env={"PYTHONHASHSEED": hash_seed, "PATH": ""},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        assert out == expected
    assert expected == "76a6d71e2ed1ac7c83ecc3a3a1458010a5133ebf3c4ef89968a3e80714619619"
    assert hash_block(ROOT_HASH, [1, 2, 3, 4], "y") != h
    assert hash_block(h, [1, 2, 3, 4], "x") != h  # the parent matters
    assert ROOT_HASH.hex() == "88416e8764ac8b67d35795bc6cc66b85ecaa748ce91e1d352fda17026b41d988"
