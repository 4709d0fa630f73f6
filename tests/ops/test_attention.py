"""Attention: a query row's bits are the same in a whole-sequence prefill, in chunks of 7/16/64, as a one-row
decode alone, and decoded or prefilled in a group with other sequences of other lengths."""

from __future__ import annotations

import pytest
import torch

from deterministic_inference.ops.attention import (
    ROW_BLOCK,
    AttentionGroup,
    AttentionMetadata,
    paged_attention,
    write_kv,
)
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

BLOCK = 16
LENGTH = 100  # the probed sequence: crosses key tiles of 32 and 64
OTHERS = [171, 37, 5]  # other sequences' lengths (longer and shorter)
DECODE_POSITIONS = [0, 1, 15, 16, 31, 32, 33, 47, 63, 64, 65, 80, 98, 99]
HEAD_SHAPES = {"smollm2": (HEADS, KV_HEADS, HEAD_DIM), "tiny": (TINY_HEADS, TINY_KV_HEADS, TINY_HEAD_DIM)}
Items = list[tuple[int, int, int]]  # (sequence, start position, query tokens); equal n in one group


class World:
    """Sequences' K/V in scattered cache blocks (written with write_kv) and queries for every position."""

    def __init__(self, head_shape: str, dtype: torch.dtype, seed: int = 0) -> None:
        heads, kv_heads, head_dim = HEAD_SHAPES[head_shape]
        generator = torch.Generator().manual_seed(seed)
        self.lengths = [LENGTH, *OTHERS]
        per_seq = [-(-length // BLOCK) for length in self.lengths]
        num_blocks = sum(per_seq) + 1
        shape = (num_blocks * BLOCK, kv_heads, head_dim)
        self.k_cache, self.v_cache = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
        order = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
        self.blocks: list[list[int]] = []
        for count, length in zip(per_seq, self.lengths, strict=True):
            self.blocks.append(order[:count])
            order = order[count:]
            keys = torch.randn(length, kv_heads, head_dim, generator=generator).to(dtype)
            values = torch.randn(length, kv_heads, head_dim, generator=generator).to(dtype)
            slots = self.slots(len(self.blocks) - 1, length, length)
            write_kv(self.k_cache, self.v_cache, keys, values, slots)
        self.queries = [
            (2 * torch.randn(n, heads, head_dim, generator=generator)).to(dtype) for n in self.lengths
        ]
        self.group_size = heads // kv_heads

    def slots(self, seq: int, seq_len: int, padded_len: int) -> torch.Tensor:
        """[padded_len] cache slots of keys 0.., slot 0 (masked) at and past seq_len, as the runner does."""
        key = torch.arange(padded_len)
        blocks = torch.tensor(self.blocks[seq])
        slots = blocks[torch.clamp(key // BLOCK, max=len(blocks) - 1)] * BLOCK + key % BLOCK
        return torch.where(key < seq_len, slots, torch.zeros_like(slots))

    def attend(
        self, items: Items, kv_tile: int, tile_rows: int, invariant: bool, row_block: int = ROW_BLOCK
    ) -> dict[tuple[int, int], torch.Tensor]:
        """Run one group; -> {(sequence, position): output row [heads, head_dim]}."""
        n = items[0][2]
        seq_lens = tuple(start + n for _, start, _ in items)
        padded_len = -(-max(seq_lens) // kv_tile) * kv_tile
        group = AttentionGroup.build(
            torch.arange(len(items) * n).view(len(items), n),
            torch.tensor([list(range(start, start + n)) for _, start, _ in items]),
            torch.stack(
                [
                    self.slots(seq, seq_len, padded_len)
                    for (seq, _, _), seq_len in zip(items, seq_lens, strict=True)
                ]
            ),
            seq_lens,
            group_size=self.group_size,
            tile_rows=tile_rows,
            kv_tile=kv_tile,
            row_block=row_block,
        )
        q = torch.cat([self.queries[seq][start : start + n] for seq, start, _ in items])
        meta = AttentionMetadata(torch.zeros(q.shape[0], dtype=torch.int64), (group,), q.shape[0])
        out = paged_attention(
            q, self.k_cache, self.v_cache, meta, scale=q.shape[-1] ** -0.5,
            kv_tile=kv_tile, tile_rows=tile_rows, batch_invariant=invariant,
        )  # fmt: skip
        return {(seq, start + r): out[i * n + r] for i, (seq, start, _) in enumerate(items) for r in range(n)}


def plans() -> dict[str, list[Items]]:
    """Ways to compute sequence 0's rows; each plan is a list of groups (steps)."""
    result: dict[str, list[Items]] = {}
    for size in (7, 16, 64):
        result[f"chunks{size}"] = [[(0, s, min(size, LENGTH - s))] for s in range(0, LENGTH, size)]
    result["decode"] = [[(0, p, 1)] for p in DECODE_POSITIONS]
    result["decode_grouped"] = [
        [(1, OTHERS[0] - 1 - p % 3, 1), (0, p, 1), (3, OTHERS[2] - 1, 1), (2, p % OTHERS[1], 1)]
        for p in DECODE_POSITIONS
    ]
    result["prefill_grouped"] = [[(1, OTHERS[0] - LENGTH, LENGTH), (0, 0, LENGTH)]]
    result["chunk16_grouped"] = [[(0, s, 16), (1, s + 50, 16)] for s in range(0, LENGTH - 16, 16)]
    return result


def mismatches(
    world: World, kv_tile: int, tile_rows: int, invariant: bool, threads: int, row_block: int = ROW_BLOCK
) -> list[str]:
    """Rows of every plan compared with a whole-sequence prefill computed with one thread (query rows
    in blocks of `row_block`: several blocks, each over only the key tiles its rows can see)."""
    with num_threads(1):
        reference = world.attend([(0, 0, LENGTH)], kv_tile, tile_rows, invariant, row_block)
    found = []
    with num_threads(threads):
        for name, plan in plans().items():
            for items in plan:
                for (seq, position), row in world.attend(items, kv_tile, tile_rows, invariant).items():
                    if seq == 0 and not torch.equal(bits(row), bits(reference[(0, position)])):
                        found.append(f"{name}@{position}")
    return found


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_shape", list(HEAD_SHAPES))
def test_rows_equal_across_prefill_chunks_decode_and_groups(
    head_shape: str, dtype: torch.dtype, threads: int
) -> None:
    world = World(head_shape, dtype)
    for kv_tile, tile_rows, row_block in ((32, 8, ROW_BLOCK), (64, 4, 12)):
        assert mismatches(world, kv_tile, tile_rows, True, threads, row_block) == [], (kv_tile, tile_rows)


def test_larger_tiles_are_invariant() -> None:
    world = World("smollm2", torch.bfloat16, seed=1)
    for kv_tile in (16, 128):
        assert mismatches(world, kv_tile, 4, True, threads=2, row_block=40) == [], kv_tile


def test_negative_control_plain_attention_differs() -> None:
    """Per-sequence SDPA (batch_invariant=False) gives prefill rows other bits than chunks or decode."""
    for dtype in DTYPES:
        assert mismatches(World("smollm2", dtype), 64, 4, False, threads=1) != [], dtype


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_invariant_attention_matches_sdpa(dtype: torch.dtype) -> None:
    world = World("smollm2", dtype)
    items: Items = [(1, 0, 40), (0, 60, 40)]
    fast = world.attend(items, 64, 4, invariant=True)
    plain = world.attend(items, 64, 4, invariant=False)
    for key in fast:
        torch.testing.assert_close(
            fast[key].float(), plain[key].float(), rtol=1e-2, atol=1e-5 if dtype == torch.float32 else 1e-2
        )


def test_mask_built_on_the_fly_gives_the_same_bits() -> None:
    world = World("tiny", torch.float32)
    group = AttentionGroup.build(
        torch.arange(8).view(2, 4), torch.tensor([[10, 11, 12, 13], [2, 3, 4, 5]]),
        torch.stack([world.slots(0, 14, 64), world.slots(2, 6, 64)]), (14, 6),
        group_size=world.group_size, tile_rows=4, kv_tile=32,
    )  # fmt: skip
    bare = AttentionGroup(
        group.row_index, group.query_positions, group.key_slots, group.seq_lens, group.seq_lens_list
    )
    q = torch.cat([world.queries[0][10:14], world.queries[2][2:6]])
    outs = []
    for g in (group, bare):
        meta = AttentionMetadata(torch.zeros(8, dtype=torch.int64), (g,), 8)
        outs.append(
            paged_attention(
                q,
                world.k_cache,
                world.v_cache,
                meta,
                scale=0.25,
                kv_tile=32,
                tile_rows=4,
                batch_invariant=True,
            )
        )
    assert torch.equal(bits(outs[0]), bits(outs[1]))


def test_key_slots_must_be_whole_tiles() -> None:
    with pytest.raises(ValueError, match="multiple of kv_tile"):
        AttentionGroup.build(
            torch.zeros(1, 1, dtype=torch.int64), torch.zeros(1, 1, dtype=torch.int64),
            torch.zeros(1, 40, dtype=torch.int64), (1,), group_size=2, tile_rows=4, kv_tile=32,
        )  # fmt: skip


def test_mixed_lengths_are_chunked_by_length() -> None:
    """A decode group of short and long sequences is split into length-sorted chunks (and the grouped
    decode plans above, which mix lengths 5..171, run through such chunks)."""
    world = World("smollm2", torch.float32)
    items: Items = [(1, 170, 1), (3, 4, 1), (0, 90, 1), (2, 3, 1)]
    seq_lens = tuple(start + 1 for _, start, _ in items)
    slots = [world.slots(seq, length, 192) for (seq, _, _), length in zip(items, seq_lens, strict=True)]
    group = AttentionGroup.build(
        torch.arange(4).view(4, 1), torch.tensor([[start] for _, start, _ in items]), torch.stack(slots),
        seq_lens, group_size=world.group_size, tile_rows=4, kv_tile=32,
    )  # fmt: skip
    assert group.tiles is not None
    assert group.tiles.row_index.flatten().tolist() == [1, 3, 2, 0]  # sorted by key tiles needed
    assert [(chunk.first, chunk.end, chunk.tiles) for chunk in group.tiles.chunks] == [(0, 2, 1), (2, 4, 6)]
