"""Attention over the paged KV cache: one path for prefill, chunked prefill and decode.

A layer's cache is two tensors of `num_blocks` blocks of `block_size` slots (slot = block_id *
block_size + offset):

    keys   [num_blocks, KVH, D, block_size]   keys transposed inside a block (key index fastest)
    values [num_blocks, KVH, block_size, D]

New K/V are written to the cache first; then every query row attends over its own sequence's keys
read back from the cache, so a token's attention never depends on whether its keys were computed in
this step, an earlier chunk or an earlier request (prefix cache).

The invariant path is the compiled kernel `ops/csrc/attention*.c` (see `ops/native.py`): every query row
in a summation order fixed by its source, over exactly the row's keys; a few tokens of a sequence share
each loaded key/value block (tiles), which changes speed, not bits. The plain path
(`kernels=None`, for `batch_invariant=False`) is torch's SDPA per sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deterministic_inference.ops.kv_format import (
    Q8_DTYPE,
    Q8Views,
    cache_head_dim,
    cache_shapes,
    dequantized_cache,
    q8_views,
    quantize_q8_0,
)
from deterministic_inference.ops.native import NativeKernels


@dataclass(frozen=True)
class SequenceRows:
    """One sequence's query tokens in a step: rows [first_row, first_row + num_rows) of the flat batch."""

    first_row: int
    num_rows: int
    start_position: int  # position of the first query token
    block_table: tuple[int, ...]  # cache blocks of keys 0.. in order (negative: released, never read)


@dataclass(frozen=True)
class AttentionMetadata:
    """Per-step attention inputs, built once per step (`build`) and shared by every layer."""

    block_size: int
    sequences: tuple[SequenceRows, ...]
    write_blocks: torch.Tensor  # [T] int64: cache block of each new token's K/V
    write_offsets: torch.Tensor  # [T] int64: slot inside that block
    block_ids: torch.Tensor  # [sum of table lengths] int64: the block tables one after another
    row_table: torch.Tensor  # [T] int64: where each token's block table starts in block_ids
    row_keys: torch.Tensor  # [T] int64: keys each token sees (its position + 1)
    max_block_id: int
    num_tokens: int  # T

    @classmethod
    def build(cls, sequences: Sequence[tuple[int, int, Sequence[int]]], block_size: int) -> AttentionMetadata:
        """From (start_position, num_tokens, block_table) per sequence, in the step's token order.

        Raises ValueError when a block table is too short for the sequence's keys."""
        rows: list[SequenceRows] = []
        write_blocks: list[int] = []
        write_offsets: list[int] = []
        block_ids: list[int] = []
        row_table: list[int] = []
        row_keys: list[int] = []
        for start, count, table in sequences:
            needed = -(-(start + count) // block_size)
            if count < 1 or start < 0 or len(table) < needed:
                raise ValueError(
                    f"attention metadata: {count} tokens from position {start} need {needed} blocks of "
                    f"{block_size}, the table has {len(table)}"
                )
            if min(table[start // block_size : needed]) < 0:
                raise ValueError(
                    f"attention metadata: a block the tokens from position {start} are written to was "
                    "released (a negative id)"
                )
            positions = range(start, start + count)
            write_blocks.extend(table[p // block_size] for p in positions)
            write_offsets.extend(p % block_size for p in positions)
            row_table.extend([len(block_ids)] * count)
            row_keys.extend(p + 1 for p in positions)
            rows.append(SequenceRows(len(row_keys) - count, count, start, tuple(table[:needed])))
            block_ids.extend(table[:needed])

        def ints(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64)

        return cls(
            block_size, tuple(rows), ints(write_blocks), ints(write_offsets), ints(block_ids),
            ints(row_table), ints(row_keys), max(block_ids, default=0), len(row_keys),
        )  # fmt: skip


def new_kv_cache(
    num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed (keys [num_blocks, KVH, D, block_size], values [num_blocks, KVH, block_size, D]); dtype
    torch.int8: a q8_0 cache (ops/kv_format.py's layouts)."""
    key_shape, value_shape = cache_shapes(num_blocks, block_size, kv_heads, head_dim, dtype)
    return torch.zeros(key_shape, dtype=dtype), torch.zeros(value_shape, dtype=dtype)


def write_kv(
    k_cache: torch.Tensor,  # [num_blocks, KVH, D, block_size]
    v_cache: torch.Tensor,  # [num_blocks, KVH, block_size, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    meta: AttentionMetadata,
) -> None:
    """Store the step's new keys and values in their cache slots (copies: exact; a q8_0 cache stores
    each token's vectors quantized by `quantize_q8_0`, from the values as the model dtype holds them)."""
    _check_blocks(k_cache, meta)
    index = (meta.write_blocks, meta.write_offsets)
    if k_cache.dtype == Q8_DTYPE:
        _write_q8(q8_views(k_cache, v_cache), k, v, index)
        return
    k_cache.permute(0, 3, 1, 2).index_put_(index, k.to(k_cache.dtype))  # view [blocks, slot, KVH, D]
    v_cache.permute(0, 2, 1, 3).index_put_(index, v.to(v_cache.dtype))


def _write_q8(
    views: Q8Views, k: torch.Tensor, v: torch.Tensor, index: tuple[torch.Tensor, torch.Tensor]
) -> None:
    """k, v [T, KVH, D] quantized (`quantize_q8_0`) into a q8_0 cache's slots `index` (blocks, offsets)."""
    key_values, key_scales = quantize_q8_0(k.float())  # [T, KVH, D], [T, KVH, D / 32]
    value_values, value_scales = quantize_q8_0(v.float())
    views.key_values.permute(0, 3, 1, 2).index_put_(index, key_values)  # view [blocks, slot, KVH, D]
    views.key_scales.permute(0, 3, 1, 2).index_put_(index, key_scales)
    views.value_values.permute(0, 2, 1, 3).index_put_(index, value_values)
    views.value_scales.permute(0, 2, 1, 3).index_put_(index, value_scales)


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, KVH, D, block_size]
    v_cache: torch.Tensor,  # [num_blocks, KVH, block_size, D]
    meta: AttentionMetadata,
    *,
    scale: float,
    kernels: NativeKernels | None,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Causal attention of every query row over its sequence's cached keys -> [T, H, D] in q's dtype.

    `window` > 0: a sliding window, as HF's: the token at position p sees keys p - window + 1 .. p only
    (`window_starts`); on the invariant path those keys exactly, in the same fixed order wherever the
    window's edge falls relative to chunks, cache blocks or the prefix cache. `softcap` > 0: each score s
    becomes tanh(s / softcap) * softcap before the softmax (Gemma 2).

    With `kernels` (invariant mode): the compiled kernel, whose rows are invariant by construction:
    each is computed alone, in an order fixed by the kernel's source, over exactly its own keys, so
    neither the batch, the chunking, the other sequences nor the thread count can change a bit.
    With `kernels=None`: plain SDPA per sequence (not invariant; benchmarks and negative controls).
    Scores, softmax and accumulation are fp32 on both paths.
    """
    _check_blocks(k_cache, meta)
    out = torch.empty(q.shape, dtype=torch.float32)
    if kernels is None:
        for rows in meta.sequences:
            _sdpa_sequence(q, k_cache, v_cache, rows, scale, out, window, softcap)
    else:
        kernels.attention(
            q.float().contiguous(), k_cache, v_cache, meta.block_ids, meta.row_table, meta.row_keys,
            scale, out, row_first=window_starts(meta, window), softcap=softcap,
        )  # fmt: skip
    return out.to(q.dtype)


def window_starts(meta: AttentionMetadata, window: int) -> torch.Tensor | None:
    """[T] int64: the first key each token sees under a sliding window of `window` keys (its position + 1
    - window, at least 0); None without a window or when no token reaches past it (all start at key 0)."""
    if window <= 0 or meta.num_tokens == 0 or int(meta.row_keys.max()) <= window:
        return None
    return (meta.row_keys - window).clamp_(min=0)


def _check_blocks(k_cache: torch.Tensor, meta: AttentionMetadata) -> None:
    """The kernel trusts block ids and sizes: refuse metadata made for another cache."""
    if meta.max_block_id >= k_cache.shape[0] or k_cache.shape[3] != meta.block_size:
        raise ValueError(
            f"attention metadata (block size {meta.block_size}, block ids up to {meta.max_block_id}) does "
            f"not fit a cache of {k_cache.shape[0]} blocks of {k_cache.shape[3]}"
        )


def sequence_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, table: Sequence[int], length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values 0..length-1 of one sequence as fp32 [KVH, length, D] each (copies: exact; a q8_0
    cache's dequantized values)."""
    blocks = torch.tensor(table, dtype=torch.int64)
    kv_heads, head_dim = k_cache.shape[1], cache_head_dim(k_cache)
    k_blocks, v_blocks = k_cache[blocks], v_cache[blocks]
    if k_cache.dtype == Q8_DTYPE:
        k_blocks, v_blocks = dequantized_cache(k_blocks, v_blocks)
    keys = k_blocks.permute(1, 0, 3, 2).reshape(kv_heads, -1, head_dim)[:, :length]
    values = v_blocks.permute(1, 0, 2, 3).reshape(kv_heads, -1, head_dim)[:, :length]
    return keys.float(), values.float()


def _sdpa_sequence(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    rows: SequenceRows,
    scale: float,
    out: torch.Tensor,  # [T, H, D] fp32, this sequence's rows written
    window: int = 0,
    softcap: float = 0.0,
) -> None:
    """Plain SDPA of one sequence's query rows over its cached keys (batch_invariant=False); with a soft
    cap, the same attention written out in torch ops (SDPA cannot cap its scores)."""
    end = rows.start_position + rows.num_rows
    block = k_cache.shape[3]
    first_block = max(0, rows.start_position - window + 1) // block if window > 0 else 0
    base = first_block * block  # the first key read: blocks before the window may be released
    table = rows.block_table[first_block:]
    if min(table) < 0:
        raise ValueError(
            f"attention: a block inside the window of position {rows.start_position} was released"
        )
    keys, values = sequence_kv(k_cache, v_cache, table, end - base)  # [KVH, L, D], key base + j at j
    token_rows = slice(rows.first_row, rows.first_row + rows.num_rows)
    queries = q[token_rows].float().transpose(0, 1)  # [H, n, D]
    query_pos = torch.arange(rows.start_position, end).view(-1, 1)
    key_pos = torch.arange(base, end).view(1, end - base)
    mask = key_pos <= query_pos  # [n, L]
    if window > 0:
        mask &= key_pos > query_pos - window
    if softcap:
        group = queries.shape[0] // keys.shape[0]
        keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)  # [H, L, D]
        scores = torch.tanh(queries @ keys.transpose(1, 2) * scale / softcap) * softcap  # [H, n, L]
        attended = scores.masked_fill(~mask, -torch.inf).softmax(-1) @ values  # [H, n, D]
    else:
        attended = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
        )  # [H, n, D]
    out[token_rows] = attended.transpose(0, 1)
