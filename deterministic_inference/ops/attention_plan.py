"""How one attention group is tiled in a step: built once per step, shared by every layer.

A group's sequences are sorted by how many key tiles they need and split into CHUNKS of similar length
(so a short sequence decoded beside a long one does not compute the long one's tiles), and each chunk's
query rows into BLOCKS of about ROW_BLOCK rows that only visit the key tiles their rows can see.

None of this changes a bit of any row: rows never share a reduction, the GEMMs' row counts stay
multiples of T, and every tile a row block skips would only have added exact zeros (x + 0 == x).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deterministic_inference.ops.linear import padded_rows

ROW_BLOCK = 384  # query rows (token x query head of a KV head) per block; rounded to a multiple of T
CHUNK_COST = 8.0  # fixed cost of one more sequence chunk, in units of one sequence x key tile (measured)


@dataclass(frozen=True)
class RowBlock:
    """Rows [first, end) of a chunk's sequences: they see `tiles` key tiles, the first `whole` in full."""

    first: int
    end: int
    tiles: int
    whole: int


@dataclass(frozen=True)
class SeqChunk:
    """Sequences [first, end) of the sorted order, attended together over their first `tiles` key tiles."""

    first: int
    end: int
    slot_offset: int  # where this chunk's keys start in TilePlan.slots
    tiles: int
    # The causal mask as arithmetic (masked_fill with a broadcast bool mask is ~40x slower than a mul):
    bias: (
        torch.Tensor
    )  # [tiles, end - first, P, B] fp32: 0, or -inf where the key is after the row's position
    keep: torch.Tensor  # [tiles, end - first, P, B] fp32: 1, or 0 where the key is after the row's position
    blocks: tuple[RowBlock, ...]


@dataclass(frozen=True)
class TilePlan:
    """Everything layer-independent about attending one group: sequence order, key slots, masks, blocks."""

    group_size: int  # G: query heads per KV head
    tile_rows: int  # T: GEMM row granularity
    kv_tile: int  # B: keys per tile
    padded: int  # P: query rows per sequence (n * G) rounded up to T
    row_index: torch.Tensor  # [S, n] int64: the group's token rows, sequences in sorted order
    slots: torch.Tensor  # [sum over chunks of tiles * S_c * B] int64: key slots, chunk then tile-major
    chunks: tuple[SeqChunk, ...]
    # Gather buffers reused by every layer of the step: a fresh multi-MB tensor per layer costs more in
    # page faults (glibc returns big blocks to the OS) than the copy itself. Contents never carry over.
    workspace: dict[str, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def create(
        cls,
        row_index: torch.Tensor,  # [S, n] int64
        query_positions: torch.Tensor,  # [S, n] int64
        key_slots: torch.Tensor,  # [S, Lp] int64, Lp a multiple of kv_tile
        seq_lens: torch.Tensor,  # [S] int64
        *,
        group_size: int,
        tile_rows: int,
        kv_tile: int,
        row_block: int = ROW_BLOCK,
    ) -> TilePlan:
        """Sort, chunk and block a group for these tile sizes."""
        num_seqs, n = query_positions.shape
        if key_slots.shape[1] % kv_tile != 0:
            raise ValueError(f"key_slots width {key_slots.shape[1]} is not a multiple of kv_tile {kv_tile}")
        padded = padded_rows(n * group_size, tile_rows)
        row_pos = query_positions.repeat_interleave(group_size, dim=1)  # [S, n*G]
        if padded > n * group_size:  # padding rows take their sequence's last position
            last = (seq_lens - 1).unsqueeze(1).expand(num_seqs, padded - n * group_size)
            row_pos = torch.cat((row_pos, last), dim=1)  # [S, P]
        needed = (seq_lens - 1) // kv_tile + 1  # [S] key tiles each sequence can see
        order = torch.sort(needed, stable=True).indices
        bounds = _partition(needed[order].tolist(), 1.0 + padded / 32)
        chunks, slot_parts, offset = [], [], 0
        step = max(tile_rows, row_block // tile_rows * tile_rows)
        for first, end in bounds:
            members = order[first:end]
            tiles = int(needed[members].max())
            chunk_slots = key_slots[members, : tiles * kv_tile].view(end - first, tiles, kv_tile)
            slot_parts.append(chunk_slots.transpose(0, 1).reshape(-1))
            chunk_pos = row_pos[members]  # [S_c, P]
            key_index = torch.arange(tiles * kv_tile).view(tiles, 1, 1, kv_tile)
            visible = key_index <= chunk_pos.view(1, end - first, padded, 1)  # [tiles, S_c, P, B]
            bias = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
            blocks = _row_blocks(chunk_pos, step, tiles, kv_tile)
            chunks.append(SeqChunk(first, end, offset, tiles, bias, visible.float(), blocks))
            offset += slot_parts[-1].shape[0]
        return cls(
            group_size, tile_rows, kv_tile, padded, row_index[order], torch.cat(slot_parts), tuple(chunks)
        )

    def fits(self, group_size: int, tile_rows: int, kv_tile: int) -> bool:
        """True when the plan was made for these sizes."""
        return (self.group_size, self.tile_rows, self.kv_tile) == (group_size, tile_rows, kv_tile)


def _row_blocks(row_pos: torch.Tensor, step: int, num_tiles: int, kv_tile: int) -> tuple[RowBlock, ...]:
    """Blocks of `step` rows of row_pos [S_c, P]: the tiles up to the latest position, and the leading
    tiles before the earliest position (no hidden key there, so no mask to apply)."""
    latest = row_pos.amax(dim=0).tolist()  # [P]
    earliest = row_pos.amin(dim=0).tolist()  # [P]
    padded = row_pos.shape[1]
    return tuple(
        RowBlock(
            first,
            min(first + step, padded),
            min(num_tiles, max(latest[first : first + step]) // kv_tile + 1),
            min(earliest[first : first + step]) // kv_tile,
        )
        for first in range(0, padded, step)
    )


def _partition(tiles: list[int], row_cost: float) -> list[tuple[int, int]]:
    """Split ascending per-sequence tile counts into contiguous chunks minimising
    sum(chunk size x chunk max x row_cost) + CHUNK_COST per chunk (exact dynamic programme, S <= a few
    hundred). Equal lengths give one chunk."""
    count = len(tiles)
    best = [0.0] + [float("inf")] * count
    start = [0] * (count + 1)
    for end in range(1, count + 1):
        for first in range(end):
            cost = best[first] + (end - first) * tiles[end - 1] * row_cost + CHUNK_COST
            if cost < best[end]:
                best[end], start[end] = cost, first
    bounds = []
    end = count
    while end > 0:
        bounds.append((start[end], end))
        end = start[end]
    return bounds[::-1]
