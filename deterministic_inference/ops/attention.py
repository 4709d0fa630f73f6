"""Attention over the paged KV cache: one path for prefill, chunked prefill and decode.

The KV cache of one layer is two flat tensors `[num_slots, kv_heads, head_dim]` (slot = block_id *
block_size + offset). New K/V are written to the cache first; then every query row attends over its
sequence's keys read back from the cache, so a token's attention never depends on whether its keys
were computed in this step, an earlier chunk, or an earlier request (prefix cache).

The invariant path works on key TILES of a fixed size B (`kv_tile`), all tiles of a group at once:

    scores[t]  = q_rows @ K[t]^T          one batched GEMM over (sequence, tile): fixed K=D, N=B
    row_max    = max over every tile       exact (max does not round)
    probs[t]   = exp(scores[t] - row_max)  masked keys give exactly 0
    out        = (sum_t probs[t] @ V[t]) / (sum_t rowsum(probs[t]))
                                           per-tile GEMM (fixed K=B), tiles added in ascending order

so no reduction ever runs over a length that depends on the batch, the chunk or the group's longest
sequence, and there is no Python loop over tiles except the fixed-order additions of tile results.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deterministic_inference.ops.linear import padded_rows

_EXP_FLOOR = -87.0  # exp(-87) = 1.6e-38, the smallest normal fp32 range: no denormal slow path


@dataclass(frozen=True)
class AttentionGroup:
    """Sequences of one step with the same number of query tokens, attended in one batched pass.

    Build it with `AttentionGroup.build()`, which also precomputes the key mask once per step (instead of
    once per layer). A group built directly (hidden_keys=None) gets its mask computed on each call.
    """

    row_index: torch.Tensor  # [S, n] int64: the step's flat token row of each query token
    query_positions: torch.Tensor  # [S, n] int64: position of each query token in its sequence
    key_slots: torch.Tensor  # [S, Lp] int64: cache slots of keys 0..Lp-1 (past seq_len: slot 0, masked)
    seq_lens: torch.Tensor  # [S] int64: keys in the cache after this step's writes
    seq_lens_list: tuple[int, ...]  # the same, as Python ints
    hidden_keys: torch.Tensor | None = None  # [S, Lp/B, P, B] bool: True = key is after the row's position

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
    ) -> AttentionGroup:
        """A group with its key mask precomputed for these tile sizes (shared by every layer of a step)."""
        if key_slots.shape[1] % kv_tile != 0:
            raise ValueError(f"key_slots width {key_slots.shape[1]} is not a multiple of kv_tile {kv_tile}")
        lens = torch.tensor(seq_lens, dtype=torch.int64)
        padded = padded_rows(row_index.shape[1] * group_size, tile_rows)
        hidden = _hidden_keys(query_positions, lens, key_slots.shape[1], group_size, padded, kv_tile)
        return cls(row_index, query_positions, key_slots, lens, tuple(seq_lens), hidden)


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


def _hidden_keys(
    query_positions: torch.Tensor,  # [S, n]
    seq_lens: torch.Tensor,  # [S]
    key_len: int,
    group_size: int,
    padded: int,
    kv_tile: int,
) -> torch.Tensor:
    """[S, Lp/B, P, B] bool: True where key t*B+j lies after query row p's position (masked).

    Row p = r*G+g is query token r seen by query head g of its KV head; padding rows take the last
    position of their sequence, so every row sees at least key 0 and its running max is finite.
    """
    num_seqs = query_positions.shape[0]
    row_pos = query_positions.repeat_interleave(group_size, dim=1)  # [S, n*G]
    if padded > row_pos.shape[1]:
        last = (seq_lens - 1).unsqueeze(1).expand(num_seqs, padded - row_pos.shape[1])
        row_pos = torch.cat((row_pos, last), dim=1)  # [S, P]
    key_index = torch.arange(key_len).view(1, key_len // kv_tile, 1, kv_tile)
    return key_index > row_pos.view(num_seqs, 1, padded, 1)


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


def _gather_keys(cache: torch.Tensor, key_slots: torch.Tensor) -> torch.Tensor:
    """cache: [slots, kv_heads, D], key_slots: [S, Lp] -> fp32 [S, Lp, kv_heads, D] (copies: exact)."""
    gathered = cache.index_select(0, key_slots.reshape(-1))
    return gathered.float().view(key_slots.shape[0], key_slots.shape[1], cache.shape[1], cache.shape[2])


def _tile_scores(q_rows: torch.Tensor, keys: torch.Tensor, kv_tile: int) -> torch.Tensor:
    """q_rows: [KVH, S, P, D], keys: [S, Lp, KVH, D] -> scores [KVH, S, Lp/B, P, B].

    Why invariant: one batched GEMM per KV head over (sequence, tile) matrices of fixed inner size D and
    fixed width B; only the padded row count P varies, in steps of `tile_rows`.
    """
    kv_heads, num_seqs, padded, head_dim = q_rows.shape
    num_tiles = keys.shape[1] // kv_tile
    batch = num_seqs * num_tiles
    scores = torch.empty((kv_heads, num_seqs, num_tiles, padded, kv_tile))
    for head in range(kv_heads):
        queries = q_rows[head].unsqueeze(1).expand(num_seqs, num_tiles, padded, head_dim)
        tile_keys = keys[:, :, head].view(batch, kv_tile, head_dim).transpose(1, 2)  # [S*nT, D, B]
        torch.bmm(
            queries.reshape(batch, padded, head_dim), tile_keys, out=scores[head].view(batch, padded, kv_tile)
        )
    return scores


def _tile_values(probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """probs: [KVH, S, nT, P, B], values: [S, Lp, KVH, D] -> per-tile outputs [KVH, S, nT, P, D].

    Why invariant: per-tile GEMMs with fixed inner size B and width D, rows padded to `tile_rows`.
    """
    kv_heads, num_seqs, num_tiles, padded, kv_tile = probs.shape
    head_dim = values.shape[3]
    batch = num_seqs * num_tiles
    tile_out = torch.empty((kv_heads, num_seqs, num_tiles, padded, head_dim))
    for head in range(kv_heads):
        tile_values = values[:, :, head].view(batch, kv_tile, head_dim)  # [S*nT, B, D]
        torch.bmm(
            probs[head].view(batch, padded, kv_tile),
            tile_values,
            out=tile_out[head].view(batch, padded, head_dim),
        )
    return tile_out


def _tiled_group_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: AttentionGroup,
    scale: float,
    kv_tile: int,
    tile_rows: int,
) -> torch.Tensor:
    """Fixed-order tiled attention with one exact row max -> [S*n, heads, head_dim] fp32.

    Why invariant: a query row's result is built only from its own sequence's keys, in tiles of
    `kv_tile` keys starting at key 0. Its max is exact whatever the tile count; each tile's scores,
    exp, tile sum (a reduction of fixed width B) and tile output (a GEMM of fixed inner size B) depend
    only on the row and that tile; the tile results are then added in ascending tile order. Keys after
    the row's position get exactly zero weight, so the extra all-zero tiles a longer neighbour adds to
    the group change no bit. GEMM row counts are padded to a multiple of `tile_rows`.
    """
    num_seqs, n = group.row_index.shape
    kv_heads = k_cache.shape[1]
    group_size = q.shape[1] // kv_heads
    padded = padded_rows(n * group_size, tile_rows)
    key_len = group.key_slots.shape[1]
    if key_len % kv_tile != 0:
        raise ValueError(f"key_slots width {key_len} is not a multiple of kv_tile {kv_tile}")
    hidden = group.hidden_keys
    if hidden is None or hidden.shape != (num_seqs, key_len // kv_tile, padded, kv_tile):
        hidden = _hidden_keys(group.query_positions, group.seq_lens, key_len, group_size, padded, kv_tile)
    q_rows = _query_rows(q, group.row_index, kv_heads, padded, scale)  # [KVH, S, P, D]
    scores = _tile_scores(q_rows, _gather_keys(k_cache, group.key_slots), kv_tile)  # [KVH, S, nT, P, B]
    scores.masked_fill_(hidden, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True).amax(dim=2, keepdim=True)  # [KVH, S, 1, P, 1]
    # exp of inputs below -87 (fp32 denormal results, -inf) takes a ~10x slower path: clamp them (the
    # result moves by < 1.2e-38), then give hidden keys exactly zero weight.
    probs = scores.sub_(row_max).clamp_min_(_EXP_FLOOR).exp_().masked_fill_(hidden, 0.0)
    tile_sums = probs.sum(dim=-1)  # [KVH, S, nT, P]
    tile_out = _tile_values(probs, _gather_keys(v_cache, group.key_slots))  # [KVH, S, nT, P, D]
    acc = tile_out[:, :, 0].clone()  # [KVH, S, P, D]
    denom = tile_sums[:, :, 0].clone()  # [KVH, S, P]
    for tile in range(1, tile_out.shape[2]):
        acc.add_(tile_out[:, :, tile])
        denom.add_(tile_sums[:, :, tile])
    result = acc.div_(denom.unsqueeze(-1))[:, :, : n * group_size]  # [KVH, S, n*G, D]
    result = result.reshape(kv_heads, num_seqs, n, group_size, -1).permute(1, 2, 0, 3, 4)
    return result.reshape(num_seqs * n, kv_heads * group_size, -1)


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
