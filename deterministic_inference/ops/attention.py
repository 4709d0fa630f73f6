"""Attention over the paged KV cache: one path for prefill, chunked prefill and decode.

The KV cache of one layer is two flat tensors `[num_slots, kv_heads, head_dim]` (slot = block_id *
block_size + offset). New K/V are written to the cache first; then every query row attends over its
sequence's keys read back from the cache, so a token's attention never depends on whether its keys
were computed in this step, an earlier chunk, or an earlier request (prefix cache).

The invariant path works on key TILES of a fixed size B (`kv_tile`), all tiles of a block of query
rows at once:

    scores[t]  = q_rows @ K[t]^T          one batched GEMM over (tile, sequence): fixed K=D, N=B
    row_max    = max over the tiles        exact (max does not round)
    probs[t]   = exp(scores[t] - row_max)  keys after the row's position get exactly 0
    out        = (sum_t probs[t] @ V[t]) / (sum_t rowsum(probs[t]))
                                           per-tile GEMM (fixed K=B), tiles added in ascending order

so no reduction runs over a length that depends on the batch, the chunk or the group's longest
sequence. Query rows are processed in blocks of ROW_BLOCK rows, each over only the tiles its rows can
see: the skipped tiles would only have added exact zeros (x + 0 == x), so a row's bits do not depend
on the blocking, and a long prefill chunk does about half the work of the full square.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from deterministic_inference.ops.linear import padded_rows

ROW_BLOCK = 384  # query rows (token x query head in a KV group) per block; rounded to a multiple of T
_EXP_FLOOR = -87.0  # exp(x < -87) is a denormal or 0 and takes a ~10x slower path: clamp (moves < 1.2e-38)


@dataclass(frozen=True)
class TilePlan:
    """How one group's query rows and keys are tiled: everything layer-independent, built once per step."""

    tile_rows: int  # T: GEMM row granularity
    kv_tile: int  # B: keys per tile
    padded: int  # P: query rows per sequence (n * group_size) rounded up to T
    slots: torch.Tensor  # [nT * S * B] int64: key slots in tile-major order (tile, sequence, key)
    hidden: torch.Tensor  # [nT, S, P, B] bool: True where the key is after the row's position
    # per row block: (first row, end row, tiles its rows can see, leading tiles every row sees whole)
    blocks: tuple[tuple[int, int, int, int], ...]
    # Gather buffers reused by every layer of the step: a fresh multi-MB tensor per layer costs more in
    # page faults (glibc returns big blocks to the OS) than the copy itself. Contents never carry over.
    workspace: dict[str, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def create(
        cls, group: AttentionGroup, group_size: int, tile_rows: int, kv_tile: int, row_block: int = ROW_BLOCK
    ) -> TilePlan:
        """Derive the plan from a group's positions and slots (row blocks of about `row_block` rows)."""
        num_seqs, n = group.query_positions.shape
        key_len = group.key_slots.shape[1]
        if key_len % kv_tile != 0:
            raise ValueError(f"key_slots width {key_len} is not a multiple of kv_tile {kv_tile}")
        num_tiles = key_len // kv_tile
        padded = padded_rows(n * group_size, tile_rows)
        row_pos = group.query_positions.repeat_interleave(group_size, dim=1)  # [S, n*G]
        if padded > n * group_size:  # padding rows take their sequence's last position
            last = (group.seq_lens - 1).unsqueeze(1).expand(num_seqs, padded - n * group_size)
            row_pos = torch.cat((row_pos, last), dim=1)  # [S, P]
        key_index = torch.arange(key_len).view(num_tiles, 1, 1, kv_tile)
        hidden = key_index > row_pos.view(1, num_seqs, padded, 1)  # [nT, S, P, B]
        slots = group.key_slots.view(num_seqs, num_tiles, kv_tile).transpose(0, 1).reshape(-1)
        step = max(tile_rows, row_block // tile_rows * tile_rows)
        latest = row_pos.amax(dim=0).tolist()  # [P]: latest position among the group's sequences
        earliest = row_pos.amin(dim=0).tolist()  # [P]: earliest one
        blocks = tuple(
            (
                first,
                min(first + step, padded),
                min(num_tiles, max(latest[first : first + step]) // kv_tile + 1),
                min(earliest[first : first + step]) // kv_tile,
            )
            for first in range(0, padded, step)
        )
        return cls(tile_rows, kv_tile, padded, slots, hidden, blocks)


@dataclass(frozen=True)
class AttentionGroup:
    """Sequences of one step with the same number of query tokens, attended in one batched pass.

    Build it with `AttentionGroup.build()`, which also precomputes the tiling (mask, slot order, row
    blocks) once per step instead of once per layer; a group built directly gets it on each call.
    """

    row_index: torch.Tensor  # [S, n] int64: the step's flat token row of each query token
    query_positions: torch.Tensor  # [S, n] int64: position of each query token in its sequence
    key_slots: torch.Tensor  # [S, Lp] int64: cache slots of keys 0..Lp-1 (past seq_len: slot 0, masked)
    seq_lens: torch.Tensor  # [S] int64: keys in the cache after this step's writes
    seq_lens_list: tuple[int, ...]  # the same, as Python ints
    tiles: TilePlan | None = None  # precomputed by build() for one (group_size, tile_rows, kv_tile)

    @classmethod
    def build(
        cls,
        row_index: torch.Tensor,  # [S, n] int64
        query_positions: torch.Tensor,  # [S, n] int64
        key_slots: torch.Tensor,  # [S, Lp] int64, Lp a multiple of kv_tile
        seq_lens: tuple[int, ...],  # S ints
        *,
        group_size: int,
        tile_rows: int,
        kv_tile: int,
        row_block: int = ROW_BLOCK,
    ) -> AttentionGroup:
        """A group with its tiling precomputed for these sizes (shared by every layer of a step)."""
        lens = torch.tensor(seq_lens, dtype=torch.int64)
        bare = cls(row_index, query_positions, key_slots, lens, tuple(seq_lens))
        return cls(
            row_index,
            query_positions,
            key_slots,
            lens,
            tuple(seq_lens),
            TilePlan.create(bare, group_size, tile_rows, kv_tile, row_block),
        )


@dataclass(frozen=True)
class AttentionMetadata:
    """Per-step attention inputs, built once per step by the model runner and passed explicitly."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot for each new token's K/V
    groups: tuple[AttentionGroup, ...]  # every query row of the step is in exactly one group
    num_tokens: int  # T


def write_kv(
    k_cache: torch.Tensor,  # [num_slots, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_slots, kv_heads, head_dim]
    k: torch.Tensor,  # [T, kv_heads, head_dim]
    v: torch.Tensor,  # [T, kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    """Store the step's new keys and values in their cache slots (a copy: exact)."""
    k_cache.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def paged_attention(
    q: torch.Tensor,  # [T, heads, head_dim]
    k_cache: torch.Tensor,  # [num_slots, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_slots, kv_heads, head_dim]
    meta: AttentionMetadata,
    *,
    scale: float,
    kv_tile: int,
    tile_rows: int,
    batch_invariant: bool,
) -> torch.Tensor:
    """Causal attention of every query row over its sequence's cached keys -> [T, heads, head_dim].

    Output dtype is q's dtype; scores, softmax and accumulation are fp32.
    """
    out = torch.empty(q.shape, dtype=torch.float32)
    for group in meta.groups:
        if batch_invariant:
            group_out = _tiled_group_attention(q, k_cache, v_cache, group, scale, kv_tile, tile_rows)
        else:
            group_out = _sdpa_group_attention(q, k_cache, v_cache, group, scale)
        out[group.row_index.reshape(-1)] = group_out  # group_out: [S*n, heads, head_dim]
    return out.to(q.dtype)


def _query_rows(
    q: torch.Tensor, row_index: torch.Tensor, kv_heads: int, padded: int, scale: float
) -> torch.Tensor:
    """q: [T, H, D] -> scaled fp32 query rows [kv_heads, S, P, D], zero rows past n*G.

    Row r*G+g of KV head h is query token r at query head h*G+g (grouped-query attention).
    """
    num_seqs, n = row_index.shape
    heads, head_dim = q.shape[1], q.shape[2]
    group_size = heads // kv_heads
    rows = n * group_size
    selected = q[row_index].view(num_seqs, n, kv_heads, group_size, head_dim)
    selected = selected.permute(2, 0, 1, 3, 4).reshape(kv_heads, num_seqs, rows, head_dim)
    q_rows = torch.zeros((kv_heads, num_seqs, padded, head_dim))
    torch.mul(selected.float(), scale, out=q_rows[:, :, :rows])
    return q_rows


def _gather_tiles(cache: torch.Tensor, plan: TilePlan, num_seqs: int, name: str) -> torch.Tensor:
    """cache: [slots, KVH, D] -> fp32 keys or values [nT, S, B, KVH, D], tile-major (copies: exact).

    Written into `plan.workspace[name]` (reused by the next layer of the step)."""
    shape = (plan.slots.shape[0], cache.shape[1], cache.shape[2])
    gathered = _buffer(plan, name, shape, torch.float32)
    if cache.dtype == torch.float32:
        torch.index_select(cache, 0, plan.slots, out=gathered)
    else:
        staged = _buffer(plan, f"{name}:{cache.dtype}", shape, cache.dtype)
        torch.index_select(cache, 0, plan.slots, out=staged)
        gathered.copy_(staged)
    return gathered.view(-1, num_seqs, plan.kv_tile, cache.shape[1], cache.shape[2])


def _buffer(plan: TilePlan, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The plan's workspace tensor `name`, (re)allocated when its shape or dtype changes."""
    buffer = plan.workspace.get(name)
    if buffer is None or buffer.shape != shape or buffer.dtype != dtype:
        buffer = torch.empty(shape, dtype=dtype)
        plan.workspace[name] = buffer
    return buffer


def _attend_block(
    q_rows: torch.Tensor,  # [KVH, S, Pb, D] fp32, Pb a multiple of T
    keys: torch.Tensor,  # [nTb, S, B, KVH, D] fp32
    values: torch.Tensor,  # [nTb, S, B, KVH, D] fp32
    hidden: torch.Tensor,  # [nTb - whole, S, Pb, B] bool: the mask of the tiles after the first `whole`
    whole: int,  # leading tiles no row of the block has a hidden key in
    out: torch.Tensor,  # [KVH, S, Pb, D] fp32, written
) -> None:
    """Attention of one block of query rows over the first nTb key tiles.

    Why invariant: per KV head, one batched GEMM over (tile, sequence) with fixed inner size D and
    width B for the scores, and one with fixed inner size B and width D for the tile outputs; only the
    row count varies, in multiples of T. The max is exact; exp, the tile sums (fixed width B) and the
    tile outputs depend only on the row and the tile; tiles are then added in ascending order.
    """
    kv_heads, num_seqs, rows, head_dim = q_rows.shape
    num_tiles, kv_tile = keys.shape[0], keys.shape[2]
    batch = num_tiles * num_seqs
    scores = torch.empty((kv_heads, num_tiles, num_seqs, rows, kv_tile))
    for head in range(kv_heads):
        queries = q_rows[head].expand(num_tiles, num_seqs, rows, head_dim).reshape(batch, rows, head_dim)
        tile_keys = keys[:, :, :, head].view(batch, kv_tile, head_dim).transpose(1, 2)  # [nT*S, D, B]
        torch.bmm(queries, tile_keys, out=scores[head].view(batch, rows, kv_tile))
    scores[:, whole:].masked_fill_(hidden, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True).amax(dim=1, keepdim=True)  # [KVH, 1, S, Pb, 1]
    probs = scores.sub_(row_max).clamp_min_(_EXP_FLOOR).exp_()
    probs[:, whole:].masked_fill_(hidden, 0.0)
    tile_sums = probs.sum(dim=-1)  # [KVH, nT, S, Pb]
    tile_out = torch.empty((kv_heads, num_tiles, num_seqs, rows, head_dim))
    for head in range(kv_heads):
        tile_values = values[:, :, :, head].view(batch, kv_tile, head_dim)  # [nT*S, B, D]
        torch.bmm(
            probs[head].view(batch, rows, kv_tile),
            tile_values,
            out=tile_out[head].view(batch, rows, head_dim),
        )
    acc = tile_out[:, 0].clone()  # [KVH, S, Pb, D]
    denom = tile_sums[:, 0].clone()  # [KVH, S, Pb]
    for tile in range(1, num_tiles):
        acc.add_(tile_out[:, tile])
        denom.add_(tile_sums[:, tile])
    torch.div(acc, denom.unsqueeze(-1), out=out)


def _tiled_group_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: AttentionGroup,
    scale: float,
    kv_tile: int,
    tile_rows: int,
) -> torch.Tensor:
    """Fixed-order tiled attention of a group -> [S*n, heads, head_dim] fp32.

    Why invariant: a query row's result is built only from its own sequence's keys, in tiles of
    `kv_tile` keys starting at key 0, by `_attend_block`. Keys after the row's position get exactly
    zero weight, so the all-zero tiles that a longer neighbour adds (or that a row block skips) change
    no bit, and padding rows never meet real rows in a reduction.
    """
    num_seqs, n = group.row_index.shape
    kv_heads = k_cache.shape[1]
    group_size = q.shape[1] // kv_heads
    plan = group.tiles
    if (
        plan is None
        or (plan.tile_rows, plan.kv_tile) != (tile_rows, kv_tile)
        or plan.padded != padded_rows(n * group_size, tile_rows)
    ):
        plan = TilePlan.create(group, group_size, tile_rows, kv_tile)
    q_rows = _query_rows(q, group.row_index, kv_heads, plan.padded, scale)  # [KVH, S, P, D]
    keys = _gather_tiles(k_cache, plan, num_seqs, "keys")  # [nT, S, B, KVH, D]
    values = _gather_tiles(v_cache, plan, num_seqs, "values")
    out = torch.empty_like(q_rows)
    for first, end, tiles, whole in plan.blocks:
        _attend_block(
            q_rows[:, :, first:end], keys[:tiles], values[:tiles], plan.hidden[whole:tiles, :, first:end],
            whole, out[:, :, first:end],
        )  # fmt: skip
    result = out[:, :, : n * group_size].reshape(kv_heads, num_seqs, n, group_size, -1)
    return result.permute(1, 2, 0, 3, 4).reshape(num_seqs * n, kv_heads * group_size, -1)


def _sdpa_group_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: AttentionGroup,
    scale: float,
) -> torch.Tensor:
    """Plain per-sequence SDPA over the gathered cache (batch_invariant=False) -> [S*n, heads, D] fp32."""
    num_seqs, n = group.row_index.shape
    outputs = []
    for seq in range(num_seqs):
        seq_len = group.seq_lens_list[seq]
        slots = group.key_slots[seq, :seq_len]
        keys = k_cache[slots].float().transpose(0, 1)  # [kv_heads, L, D]
        values = v_cache[slots].float().transpose(0, 1)  # [kv_heads, L, D]
        queries = q[group.row_index[seq]].float().transpose(0, 1)  # [heads, n, D]
        key_pos = torch.arange(seq_len)
        mask = key_pos.view(1, seq_len) <= group.query_positions[seq].view(n, 1)  # [n, L]
        attended = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
        )  # [heads, n, D]
        outputs.append(attended.transpose(0, 1))
    return torch.cat(outputs, dim=0)
