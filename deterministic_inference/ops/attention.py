"""Attention over the paged KV cache: one path for prefill, chunked prefill and decode.

The KV cache of one layer is two flat tensors `[num_slots, kv_heads, head_dim]` (slot = block_id *
block_size + offset). New K/V are written to the cache first; then every query row attends over its
sequence's keys read back from the cache, so a token's attention never depends on whether its keys
were computed in this step, an earlier chunk, or an earlier request (prefix cache).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deterministic_inference.ops.linear import padded_rows


@dataclass(frozen=True)
class AttentionGroup:
    """Sequences of one step with the same number of query tokens, attended in one batched pass."""

    row_index: torch.Tensor  # [S, n] int64: the step's flat token row of each query token
    query_positions: torch.Tensor  # [S, n] int64: position of each query token in its sequence
    key_slots: torch.Tensor  # [S, Lp] int64: cache slots of keys 0..Lp-1 (past seq_len: slot 0, masked)
    seq_lens: torch.Tensor  # [S] int64: keys in the cache after this step's writes
    seq_lens_list: tuple[int, ...]  # the same, as Python ints


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


def _tiled_group_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: AttentionGroup,
    scale: float,
    kv_tile: int,
    tile_rows: int,
) -> torch.Tensor:
    """Fixed-order tiled attention with an online softmax -> [S*n, heads, head_dim] fp32.

    Why invariant: a query row's result is built from its own sequence's keys in tiles of `kv_tile`
    keys, always starting at key 0 and merged in ascending order with a running max, running sum and
    accumulator in fp32. Each tile's two GEMMs see a row count padded to a multiple of `tile_rows`
    (the batched GEMM was measured row- and batch-invariant that way) and fixed inner sizes
    (head_dim, kv_tile); softmax pieces are whole-tile reductions of fixed width. Keys past a row's
    position are -inf (exactly zero weight), and tiles with no visible key leave the row's state
    untouched (torch.where), so rows of different lengths, chunks or batches cannot meet in a sum.
    """
    num_seqs, n = group.row_index.shape
    kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2]
    group_size = q.shape[1] // kv_heads
    rows = n * group_size
    padded = padded_rows(rows, tile_rows)
    # q_rows: [S, kv_heads, padded, D], row r*G+g = query token r, query head h*G+g
    q_sel = q[group.row_index].float().view(num_seqs, n, kv_heads, group_size, head_dim)
    q_rows = q_sel.permute(0, 2, 1, 3, 4).reshape(num_seqs, kv_heads, rows, head_dim)
    if padded != rows:
        q_rows = F.pad(q_rows, (0, 0, 0, padded - rows))
    batch = num_seqs * kv_heads
    q_rows = (q_rows * scale).reshape(batch, padded, head_dim).contiguous()
    # row_pos: [S, padded] position of each (token, head-in-group) row; padding rows see every key
    row_pos = group.query_positions.repeat_interleave(group_size, dim=1)
    if padded != rows:
        last = (group.seq_lens - 1).unsqueeze(1).expand(num_seqs, padded - rows)
        row_pos = torch.cat((row_pos, last), dim=1)
    row_pos = row_pos.unsqueeze(1).expand(num_seqs, kv_heads, padded).reshape(batch, padded, 1)
    keys = k_cache[group.key_slots].float().permute(0, 2, 3, 1)  # [S, kv_heads, D, Lp]
    values = v_cache[group.key_slots].float().permute(0, 2, 1, 3)  # [S, kv_heads, Lp, D]
    keys = keys.reshape(batch, head_dim, -1)
    values = values.reshape(batch, -1, head_dim)
    run_max = torch.full((batch, padded, 1), float("-inf"))
    run_sum = torch.zeros((batch, padded, 1))
    acc = torch.zeros((batch, padded, head_dim))
    num_tiles = -(-max(group.seq_lens_list) // kv_tile)
    key_offsets = torch.arange(kv_tile)
    for tile in range(num_tiles):
        start = tile * kv_tile
        visible = (start + key_offsets).view(1, 1, kv_tile) <= row_pos  # [batch, padded, B]
        any_visible = visible[:, :, :1]  # key `start` visible <=> some key of the tile is
        scores = torch.bmm(q_rows, keys[:, :, start : start + kv_tile].contiguous())  # [batch, padded, B]
        scores = torch.where(visible, scores, float("-inf"))
        new_max = torch.maximum(run_max, scores.amax(dim=-1, keepdim=True))
        new_max = torch.where(any_visible, new_max, run_max)
        probs = torch.exp(scores - new_max)  # masked keys: exactly 0
        correction = torch.exp(run_max - new_max)
        tile_out = torch.bmm(probs, values[:, start : start + kv_tile].contiguous())  # [batch, padded, D]
        run_sum = torch.where(any_visible, run_sum * correction + probs.sum(dim=-1, keepdim=True), run_sum)
        acc = torch.where(any_visible, acc * correction + tile_out, acc)
        run_max = new_max
    result = (acc / run_sum).view(num_seqs, kv_heads, padded, head_dim)[:, :, :rows]
    result = result.reshape(num_seqs, kv_heads, n, group_size, head_dim).permute(0, 2, 1, 3, 4)
    return result.reshape(num_seqs * n, kv_heads * group_size, head_dim)


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
