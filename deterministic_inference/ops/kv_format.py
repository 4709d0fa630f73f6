"""The KV cache's storage formats (`--kv-cache-dtype`): the model dtype, bf16, or q8_0.

A layer's cache is two tensors. For fp32 and bf16 caches (see ops/attention.py):

    keys   [num_blocks, KVH, D, block]   values [num_blocks, KVH, block, D]

A q8_0 cache (csrc/kv_q8.h) is int8: each (token, KV head) vector is cut into D / 32 groups of 32 values
along head_dim, a group stored as 32 int8 values and one fp32 scale, packed per cache block:

    keys   [num_blocks, KVH, D * 9 / 8, block]: rows 0..D-1 the int8 keys transposed, then the scales'
           bytes, fp32 [D / 32][block]
    values [num_blocks, KVH, block, D * 9 / 8]: per token its D int8 values, then its D / 32 fp32 scales

A cache tensor's dtype names its format (torch.int8 is q8_0). The quantizer and dequantizer here are the
torch twins of the C ones (same IEEE operations: a fp32 division by 127, a division by the scale, round
half to even; one fp32 multiply back), used by the plain torch path, the probes and the tests' reference.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

KV_CACHE_DTYPES = ("auto", "bf16", "q8_0")  # the option's choices; auto = the model dtype
Q8_GROUP = 32  # values per q8_0 group (along head_dim)
Q8_DTYPE = torch.int8  # the cache tensors' dtype that marks q8_0
# the kernels' cache dtype codes (csrc/kv_q8.h: KV_F32, KV_BF16, KV_Q8)
_CODES = {torch.float32: 0, torch.bfloat16: 1, Q8_DTYPE: 2}


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of the cache tensors for an option value: auto -> the model dtype, bf16 ->
    torch.bfloat16, q8_0 -> torch.int8. ValueError for any other value."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "bf16":
        return torch.bfloat16
    if kv_cache_dtype == "q8_0":
        return Q8_DTYPE
    raise ValueError(f"kv_cache_dtype: {kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}")


def q8_row_bytes(head_dim: int) -> int:
    """Bytes of one stored q8_0 vector of head_dim values: the int8 values and their fp32 scales."""
    return head_dim + 4 * (head_dim // Q8_GROUP)


def cache_shapes(
    num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(key shape, value shape) of one layer's cache in `dtype` (the module docstring's layouts)."""
    width = q8_row_bytes(head_dim) if dtype == Q8_DTYPE else head_dim
    return (num_blocks, kv_heads, width, block_size), (num_blocks, kv_heads, block_size, width)


def cache_bytes_per_token(kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one token's keys and values take in one layer's cache."""
    if dtype == Q8_DTYPE:
        return 2 * kv_heads * q8_row_bytes(head_dim)
    return 2 * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def cache_head_dim(k_cache: torch.Tensor) -> int:
    """head_dim of a key cache [blocks, KVH, width, block] of any format."""
    width = k_cache.shape[2]
    return width * 8 // 9 if k_cache.dtype == Q8_DTYPE else width


def cache_code(k_cache: torch.Tensor) -> int:
    """The kernels' code of the cache's format; ValueError for a dtype no kernel reads."""
    code = _CODES.get(k_cache.dtype)
    if code is None:
        raise ValueError(f"KV cache: {k_cache.dtype} is not a cache format (fp32, bf16 or int8 = q8_0)")
    return code


class Q8Views(NamedTuple):
    """Views into a q8_0 cache's bytes (writes through them change the cache)."""

    key_values: torch.Tensor  # [blocks, KVH, D, block] int8
    key_scales: torch.Tensor  # [blocks, KVH, D / 32, block] fp32
    value_values: torch.Tensor  # [blocks, KVH, block, D] int8
    value_scales: torch.Tensor  # [blocks, KVH, block, D / 32] fp32


def q8_views(k_cache: torch.Tensor, v_cache: torch.Tensor) -> Q8Views:
    """The int8 values and fp32 scales of a contiguous q8_0 cache (or of some of its blocks) as views."""
    blocks, kv_heads, width, block = k_cache.shape
    dim = cache_head_dim(k_cache)
    key_slices = k_cache.view(blocks, kv_heads, width * block)
    key_scales = key_slices[:, :, dim * block :].view(torch.float32).view(blocks, kv_heads, -1, block)
    value_scales = v_cache[..., dim:].view(torch.float32)  # [blocks, KVH, block, D / 32]
    return Q8Views(k_cache[:, :, :dim], key_scales, v_cache[..., :dim], value_scales)


def quantize_q8_0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] fp32 -> (int8 [..., D], fp32 scales [..., D / 32]): per group of 32 along the last dim,
    scale = amax / 127, q = round half to even of clamp(x / scale, -127, 127), 0 where scale is 0 (and for
    NaN). Why portable: each step is one IEEE fp32 operation on the group's own values (the C quantizer in
    csrc/kv_q8.h performs the same ones)."""
    groups = x.float().reshape(*x.shape[:-1], x.shape[-1] // Q8_GROUP, Q8_GROUP)
    scales = groups.abs().amax(dim=-1) / 127.0  # [..., D / 32]
    ratios = (groups / scales.unsqueeze(-1)).clamp(-127.0, 127.0)
    rounded = torch.nan_to_num(torch.round(ratios), nan=0.0)
    rounded = torch.where(scales.unsqueeze(-1) == 0, torch.zeros_like(rounded), rounded)
    return rounded.to(torch.int8).reshape(x.shape), scales


def dequantize_q8_0(values: torch.Tensor, scales: torch.Tensor, axis: int) -> torch.Tensor:
    """int8 `values` times their group's fp32 scale (one fp32 multiply each) -> fp32; `axis` is the
    head_dim axis of `values`, along which `scales` has one entry per 32 values."""
    return values.float() * scales.repeat_interleave(Q8_GROUP, dim=axis)


def dequantized_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks of a q8_0 cache as fp32 (keys [n, KVH, D, block], values [n, KVH, block, D]): the values
    the attention kernels compute with."""
    views = q8_views(k_cache.contiguous(), v_cache.contiguous())
    keys = dequantize_q8_0(views.key_values, views.key_scales, axis=2)
    values = dequantize_q8_0(views.value_values, views.value_scales, axis=3)
    return keys, values
