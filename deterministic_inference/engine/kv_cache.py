"""Paged KV block pool with automatic prefix caching.

The pool has `num_blocks` blocks of `block_size` token slots, with ids 0..num_blocks-1. A request's block
table (`request.block_ids`) maps its token positions to blocks: token t lives in block_ids[t // block_size].

Prefix cache. A FULL block whose KV has been computed is registered under a chained hash:

    hash(block i) = sha256(parent || "tokens" || len || token ids as int64 LE || "extra" || len || hash_extra)

with parent = hash(block i-1) and, for block 0, the fixed root sha256(b"detinf-root"). The encoding is
canonical bytes (never Python `hash()`), so every process, whatever PYTHONHASHSEED, computes the same
hashes; `hash_extra` carries the engine's model/numerics fingerprint, so KV computed under other numerics
can never match. A new request takes the longest chain of cached blocks matching its tokens (ref count
+1, shared with running requests), except the block holding its last known token: that token is always
recomputed so its logits exist. Hits are bitwise identical to misses because attention reads the same
cached K/V values in the same block order either way.

Sliding windows (`sliding_window` > 0: EVERY layer of the model attends over a window of that many keys;
a query at position q sees keys q - W + 1 .. q). A block whose last position p satisfies p < q_min - W + 1,
with q_min the first position the sequence computes next (a chunk's first token: every later query sees
even less), is needed by no future query, so `allocate` releases it before taking new blocks: memory follows
the window, not the sequence, and a sequence holds at most `window_block_limit` blocks. The block table
keeps its length (token t still lives in block_ids[t // block_size]); a released entry becomes FREED_BLOCK,
which the attention never reads (the kernel starts at the block holding the window's first key and refuses a
negative id there; the write path and the plain SDPA path check too). Releasing is `free` for one block:
a block registered in the prefix cache stays cached and evictable for other requests; a block shared with
another request only loses this request's reference. A prefix hit of a later request still matches by the
chained hashes from block 0 (the early blocks must still be cached), and the hit's blocks before its window
are not taken at all (their entries start as FREED_BLOCK). Bits cannot change: the kept blocks hold the same
K/V, and no query reads a released one. Rollback (`release_tail`) and preemption (`free`, then recompute
from scratch) only ever meet kept blocks.

Block states and allocation order (pinned by tests/engine/test_kv_cache.py):
  * in use: ref count > 0 (shared blocks have ref > 1);
  * cached and unreferenced: ref 0 with a hash: still reusable by a prefix hit, and an eviction candidate;
  * truly free: ref 0 and no hash, kept in a min-heap by block id.
New blocks come from the truly free blocks first, LOWEST ID FIRST. Only when none is left is a cached
unreferenced block evicted (its hash dropped): the least recently freed one. "Recently" is a LOGICAL
clock, a counter that `free` advances once per block it releases; `free` releases a request's blocks from
its LAST block to its first, so the tail of a chain (least likely to be shared) is evicted before its
head, and blocks of requests freed earlier are evicted before those freed later. Ties cannot happen
(each release gets a new clock value); the order is (release time, block id). No wall clock anywhere.
"""

from __future__ import annotations

import hashlib
import heapq
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from deterministic_inference.engine.request import Request
from deterministic_inference.errors import ConfigError

ROOT_HASH = hashlib.sha256(b"detinf-root").digest()
FREED_BLOCK = -1  # a block-table entry released because no future query's window reaches it


def hash_block(parent: bytes, token_ids: Sequence[int], extra: str) -> bytes:
    """Chained hash of one full block: sha256 over canonical bytes of (parent, token ids, extra keys).

    Pure and process-independent: only sha256 over explicit little-endian integers and UTF-8 text.
    """
    extra_bytes = extra.encode("utf-8")
    payload = b"".join(
        (
            parent,
            b"tokens",
            struct.pack("<q", len(token_ids)),
            struct.pack(f"<{len(token_ids)}q", *token_ids),
            b"extra",
            struct.pack("<q", len(extra_bytes)),
            extra_bytes,
        )
    )
    return hashlib.sha256(payload).digest()


@dataclass
class PrefixCacheStats:
    """Cumulative prefix-cache counters (plain ints)."""

    queries: int = 0  # admissions that looked up the cache
    queried_tokens: int = 0  # known tokens of those requests
    hit_tokens: int = 0  # tokens taken from the cache
    evictions: int = 0  # cached blocks whose hash was dropped to reuse the block


class KVCacheManager:
    """Block pool + prefix cache; owns every request's `block_ids`. See the module docstring for the
    allocation and eviction order."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        hash_extra: str,
        sliding_window: int = 0,
    ) -> None:
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name}: {value!r} must be a positive integer")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # every layer's window in keys: blocks before it are released (0: keep every block to the end)
        self.sliding_window = sliding_window
        self.hash_extra = hash_extra
        self.stats = PrefixCacheStats()
        self._ref = [0] * num_blocks
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._release_time = [-1] * num_blocks  # logical time of the last release to ref 0
        self._cached: dict[bytes, int] = {}  # hash -> block id (lookups only, never iterated)
        self._free: list[int] = list(range(num_blocks))  # min-heap of truly free block ids
        self._evictable: list[tuple[int, int]] = []  # min-heap (release time, block id), lazily pruned
        self._num_evictable = 0
        self._clock = 0
        self._num_committed: dict[str, int] = {}  # request id -> its blocks already registered

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation can take: truly free plus cached-but-unreferenced."""
        return len(self._free) + self._num_evictable

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache (referenced or not)."""
        return len(self._cached)

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def block_hash_of(self, block_id: int) -> bytes | None:
        """The hash a block is cached under, None when it is not in the prefix cache."""
        return self._block_hash[block_id]

    def num_held_blocks(self, request: Request) -> int:
        """Blocks `request` holds now (its block table without the entries released behind its window)."""
        return sum(1 for block in request.block_ids if block != FREED_BLOCK)

    def window_block_limit(self, chunk_tokens: int) -> int:
        """Most blocks a sequence ever holds when its chunks have at most `chunk_tokens` tokens: its
        computed keys in the window of the chunk's first query (W - 1) plus the chunk, over blocks that
        may straddle both ends: ceil((W - 1 + chunk) / block) + 1. 0 without window freeing (no bound)."""
        if self.sliding_window <= 0:
            return 0
        return -(-(self.sliding_window - 1 + chunk_tokens) // self.block_size) + 1

    def free_block_ids(self) -> list[int]:
        """Truly free block ids, ascending (for tests and the trace)."""
        return sorted(self._free)

    def get_computed_prefix(self, request: Request) -> int:
        """Known tokens of `request` whose full blocks are cached: a multiple of block_size, never all of
        them (the last known token is always recomputed). 0 when caching is off or the request wants
        prompt logprobs (those need logits for every prompt position). Changes no pool state."""
        return len(self._lookup(request)) * self.block_size

    def allocate(self, request: Request, num_new_tokens: int) -> bool:
        """Make `request.block_ids` cover num_computed_tokens + num_new_tokens tokens.

        On the first allocation (empty block table: new or preempted request) the cached prefix blocks
        are taken (ref +1) and num_computed_tokens / num_cached_tokens set to the hit length. With a
        sliding window, the blocks before the window of the first new token are released (or, for hits,
        not taken) first. Returns False, changing nothing, when the pool has too few blocks.
        """
        first = not request.block_ids
        hits = self._lookup(request) if first else []
        computed = len(hits) * self.block_size if first else request.num_computed_tokens
        expired = self._expired_blocks(computed)
        needed = -(-(computed + num_new_tokens) // self.block_size)
        num_new_blocks = max(0, needed - len(request.block_ids) - len(hits))
        idle_hits = sum(1 for block in hits[expired:] if self._ref[block] == 0)
        released = [] if first else self._held_before(request, expired)
        returning = sum(1 for index in released if self._ref[request.block_ids[index]] == 1)
        if num_new_blocks > self.num_free_blocks - idle_hits + returning:
            return False
        if first:
            self._take_hits(request, hits, expired)
        for index in reversed(released):  # last block first, as `free` does
            self._release(request.block_ids[index])
            request.block_ids[index] = FREED_BLOCK
        for _ in range(num_new_blocks):
            request.block_ids.append(self._take_block())
        return True

    def commit_full_blocks(self, request: Request) -> None:
        """Register the request's newly FULL computed blocks (prompt and output tokens) in the prefix
        cache. A block whose hash is already cached under another block stays private (freed normally)."""
        if not self.enable_prefix_caching:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_ids))
        start = self._num_committed.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self._hashes(request, num_full)
        for index in range(start, num_full):
            block = request.block_ids[index]
            if block != FREED_BLOCK and self._block_hash[block] is None and hashes[index] not in self._cached:
                self._block_hash[block] = hashes[index]
                self._cached[hashes[index]] = block
        self._num_committed[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks, last block first (see the eviction order in the module
        docstring); unreferenced cached blocks stay reusable, the others return to the free heap."""
        for block in reversed(request.block_ids):
            if block != FREED_BLOCK:
                self._release(block)
        request.block_ids = []
        self._num_committed.pop(request.request_id, None)

    def release_tail(self, request: Request, num_tokens: int) -> None:
        """Speculation's KV rollback: give back the request's blocks past the first `num_tokens` token
        slots (they hold only rejected drafts' K/V, never registered: only full blocks of computed,
        verified tokens are), last block first like `free`."""
        keep = -(-num_tokens // self.block_size)
        while len(request.block_ids) > keep:
            block = request.block_ids.pop()
            if block == FREED_BLOCK:
                raise RuntimeError("KV rollback reached a block released behind the sliding window")
            self._ref[block] -= 1
            if self._ref[block] == 0:
                if self._block_hash[block] is not None:
                    raise RuntimeError(f"KV block {block}: a cached block past the known tokens")
                heapq.heappush(self._free, block)
                self._clock += 1

    def flush(self) -> int:
        """Drop every cached block no request holds (they become truly free); returns how many."""
        dropped = 0
        for block in range(self.num_blocks):
            block_hash = self._block_hash[block]
            if block_hash is not None and self._ref[block] == 0:
                self._uncache(block, block_hash)
                heapq.heappush(self._free, block)
                dropped += 1
        self._evictable = []
        self._num_evictable = 0
        return dropped

    # -- internals -------------------------------------------------------------------------------

    def _lookup(self, request: Request) -> list[int]:
        """Cached blocks matching the request's leading full blocks, excluding its last known token."""
        if not self.enable_prefix_caching or request.params.prompt_logprobs is not None:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for block_hash in self._hashes(request, max_blocks):
            block = self._cached.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def _hashes(self, request: Request, count: int) -> list[bytes]:
        """The request's first `count` chained block hashes, memoized on the request (tokens never
        change once known, so the memo stays valid across preemption)."""
        hashes = request.block_hashes
        if len(hashes) < count:
            tokens = request.all_token_ids
            size = self.block_size
            parent = hashes[-1] if hashes else ROOT_HASH
            for index in range(len(hashes), count):
                parent = hash_block(parent, tokens[index * size : (index + 1) * size], self.hash_extra)
                hashes.append(parent)
        return hashes[:count]

    def _take_hits(self, request: Request, hits: list[int], expired: int) -> None:
        """Take the hit blocks from `expired` on (ref +1); the first `expired` lie wholly before the
        window of the first token to compute, so no query of this request reads them: not taken."""
        for block in hits[expired:]:
            if self._ref[block] == 0:
                self._num_evictable -= 1  # its heap entry becomes stale (checked on pop)
            self._ref[block] += 1
        request.block_ids = [FREED_BLOCK] * expired + hits[expired:]
        request.num_computed_tokens = len(hits) * self.block_size
        request.num_cached_tokens = request.num_computed_tokens
        self._num_committed[request.request_id] = len(hits)
        self.stats.queries += 1
        self.stats.queried_tokens += request.num_tokens
        self.stats.hit_tokens += request.num_cached_tokens

    def _expired_blocks(self, first_query: int) -> int:
        """How many leading blocks lie wholly before the window of the query at `first_query` (and of
        every later one): block b's last key (b + 1) * size - 1 < first_query - W + 1. 0 without window
        freeing."""
        if self.sliding_window <= 0:
            return 0
        return max(0, first_query - self.sliding_window + 1) // self.block_size

    def _held_before(self, request: Request, expired: int) -> list[int]:
        """Indices of the request's first `expired` block-table entries it still holds."""
        count = min(expired, len(request.block_ids))
        return [index for index in range(count) if request.block_ids[index] != FREED_BLOCK]

    def _release(self, block: int) -> None:
        """Drop one reference; at ref 0 a cached block becomes evictable (at the next logical time),
        an uncached one truly free."""
        self._ref[block] -= 1
        if self._ref[block] > 0:
            return
        if self._block_hash[block] is None:
            heapq.heappush(self._free, block)
        else:
            self._release_time[block] = self._clock
            heapq.heappush(self._evictable, (self._clock, block))
            self._num_evictable += 1
        self._clock += 1

    def _take_block(self) -> int:
        """A block for new KV: lowest truly free id, else evict the least recently released cached one."""
        if self._free:
            block = heapq.heappop(self._free)
        else:
            block = self._pop_evictable()
        self._ref[block] = 1
        return block

    def _pop_evictable(self) -> int:
        while self._evictable:
            time, block = heapq.heappop(self._evictable)
            block_hash = self._block_hash[block]
            if self._ref[block] == 0 and block_hash is not None and self._release_time[block] == time:
                self._uncache(block, block_hash)
                self._num_evictable -= 1
                self.stats.evictions += 1
                return block
        raise RuntimeError("KV block pool exhausted: allocate() must check num_free_blocks first")

    def _uncache(self, block: int, block_hash: bytes) -> None:
        self._block_hash[block] = None
        del self._cached[block_hash]
