"""Memory of the paged KV cache: allocated as address space, resident only where blocks are written.

Every layer's key and value tensors are views into one private anonymous memory map. The kernel backs a
page with memory the first time it is written, and the block pool hands out the lowest free block ids
first (`KVCacheManager`), so the resident KV memory follows the highest block id in use, not the pool's
size: a 2 GiB pool holding one short request costs a few pages per layer. Unwritten pages read as zeros,
so the caches start exactly like `torch.zeros` (no value depends on this choice).
"""

from __future__ import annotations

import mmap

import torch

from deterministic_inference.model_spec import ModelSpec
from deterministic_inference.ops.kv_format import cache_bytes_per_token, cache_shapes

_PAGE = mmap.PAGESIZE
def kv_block_bytes(spec: ModelSpec, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one KV block takes over all layers (keys and values) in the cache format `dtype` (torch.int8:
    q8_0, 36 bytes per 32 values)."""
    return spec.num_layers * block_size * cache_bytes_per_token(spec.num_kv_heads, spec.head_dim, dtype)


def lazy_kv_caches(
    num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zero-filled caches of every layer, (keys [blocks, KVH, D, block_size], values [blocks, KVH,
    block_size, D]) per layer (dtype torch.int8: q8_0, ops/kv_format.py's layouts), in one memory map
    whose pages become resident when first written."""
    element = torch.empty((), dtype=dtype).element_size()
    key_shape, value_shape = cache_shapes(num_blocks, block_size, kv_heads, head_dim, dtype)
    tensor_bytes = num_blocks * key_shape[1] * key_shape[2] * key_shape[3] * element
    stride = -(-tensor_bytes // _PAGE) * _PAGE  # each tensor starts on its own page
    region = mmap.mmap(-1, 2 * num_layers * stride, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        region.madvise(mmap.MADV_NOHUGEPAGE)  # grow in small pages even where THP is "always"
    flat = torch.frombuffer(region, dtype=torch.uint8)  # keeps the map alive while any view lives
    caches = []
    for layer in range(num_layers):
        start = 2 * layer * stride
        keys = flat[start : start + tensor_bytes].view(dtype).view(key_shape)
        values = flat[start + stride : start + stride + tensor_bytes].view(dtype).view(value_shape)
        caches.append((keys, values))
    return caches
