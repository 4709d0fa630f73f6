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
sequence. `attention_plan.TilePlan` (built once per step) sorts a group's sequences into chunks of
similar length and their query rows into blocks that visit only the key tiles they can see: skipped
tiles would only have added exact zeros (x + 0 == x), so no bit depends on the chunking or blocking,
and a long prefill chunk does about half the work of the full square.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deterministic_inference.ops.attention_plan import ROW_BLOCK, TilePlan

__all__ = ["ROW_BLOCK", "AttentionGroup", "AttentionMetadata", "TilePlan", "paged_attention", "write_kv"]

_EXP_FLOOR = -87.0  # exp(x < -87) is a denormal or 0 and takes a ~10x slower path: clamp (moves < 1.2e-38)


@dataclass(frozen=True)
class AttentionGroup:
    """Sequences of one step with the same number of query tokens, attended in one batched pass.

    Build it with `AttentionGroup.build()`, which also precomputes the tiling (sequence order, masks,
    slot order, row blocks) once per step instead of once per layer; a group built directly gets it
    on each call.
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
        plan = TilePlan.create(
            row_index, query_positions, key_slots, lens,
            group_size=group_size, tile_rows=tile_rows, kv_tile=kv_tile, row_block=row_block,
        )  # fmt: skip
        return cls(row_index, query_positions, key_slots, lens, tuple(seq_lens), plan)


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
            rows, group_out = _tiled_group_attention(q, k_cache, v_cache, group, scale, kv_tile, tile_rows)
        else:
            rows, group_out = group.row_index, _sdpa_group_attention(q, k_cache, v_cache, group, scale)
        out[rows.reshape(-1)] = group_out  # group_out: [S*n, heads, head_dim], rows: [S, n]
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


def _gather_keys(cache: torch.Tensor, plan: TilePlan, name: str) -> torch.Tensor:
    """cache: [slots, KVH, D] -> fp32 [len(plan.slots), KVH, D] in the plan's key order (copies: exact).

    Written into `plan.workspace[name]`, which the next layer of the step reuses."""
    shape = (plan.slots.shape[0], cache.shape[1], cache.shape[2])
    gathered = _buffer(plan, name, shape, torch.float32)
    if cache.dtype == torch.float32:
        torch.index_select(cache, 0, plan.slots, out=gathered)
    else:
        staged = _buffer(plan, f"{name}:{cache.dtype}", shape, cache.dtype)
        torch.index_select(cache, 0, plan.slots, out=staged)
        gathered.copy_(staged)
    return gathered


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
    bias: torch.Tensor,  # [nTb - whole, S, Pb, B] fp32: 0 / -inf, the mask of the tiles after `whole`
    keep: torch.Tensor,  # [nTb - whole, S, Pb, B] fp32: 1 / 0, the same mask
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
    scores[:, whole:].add_(bias)  # hidden keys -inf, others unchanged (x + 0 == x)
    row_max = scores.amax(dim=-1, keepdim=True).amax(dim=1, keepdim=True)  # [KVH, 1, S, Pb, 1]
    probs = scores.sub_(row_max).clamp_min_(_EXP_FLOOR).exp_()
    probs[:, whole:].mul_(keep)  # hidden keys exactly 0, others unchanged (x * 1 == x)
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed-order tiled attention of a group -> (token rows [S, n], output [S*n, heads, head_dim] fp32).

    Why invariant: a query row's result is built only from its own sequence's keys, in tiles of
    `kv_tile` keys starting at key 0, by `_attend_block`. Keys after the row's position get exactly
    zero weight, so the all-zero tiles that a longer neighbour adds (or that a row block skips) change
    no bit, and padding rows never meet real rows in a reduction. Sequences are processed in the plan's
    order (by length); the returned token rows say where each output row belongs.
    """
    kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2]
    group_size = q.shape[1] // kv_heads
    plan = group.tiles
    if plan is None or not plan.fits(group_size, tile_rows, kv_tile):
        plan = TilePlan.create(
            group.row_index, group.query_positions, group.key_slots, group.seq_lens,
            group_size=group_size, tile_rows=tile_rows, kv_tile=kv_tile,
        )  # fmt: skip
    num_seqs, n = plan.row_index.shape
    q_rows = _query_rows(q, plan.row_index, kv_heads, plan.padded, scale)  # [KVH, S, P, D], plan order
    keys = _gather_keys(k_cache, plan, "keys")  # [keys, KVH, D]
    values = _gather_keys(v_cache, plan, "values")
    out = torch.empty_like(q_rows)
    for chunk in plan.chunks:
        seqs = slice(chunk.first, chunk.end)
        span = slice(chunk.slot_offset, chunk.slot_offset + chunk.tiles * (chunk.end - chunk.first) * kv_tile)
        tile_shape = (chunk.tiles, chunk.end - chunk.first, kv_tile, kv_heads, head_dim)
        chunk_keys, chunk_values = keys[span].view(tile_shape), values[span].view(tile_shape)
        for block in chunk.blocks:
            rows, masked = slice(block.first, block.end), slice(block.whole, block.tiles)
            _attend_block(
                q_rows[:, seqs, rows], chunk_keys[: block.tiles], chunk_values[: block.tiles],
                chunk.bias[masked, :, rows], chunk.keep[masked, :, rows], block.whole, out[:, seqs, rows],
            )  # fmt: skip
    result = out[:, :, : n * group_size].reshape(kv_heads, num_seqs, n, group_size, head_dim)
    return plan.row_index, result.permute(1, 2, 0, 3, 4).reshape(
        num_seqs * n, kv_heads * group_size, head_dim
    )


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
