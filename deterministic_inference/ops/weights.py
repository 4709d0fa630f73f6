"""Weights as the loaders hand them out, and the embedding lookup over them.

A `StoredWeight` is one named tensor of a model, in the form it was stored:

- a dense float tensor (F32, F16, BF16 in a GGUF file; safetensors), possibly a view on the file's
  memory map;
- a `QuantizedWeight` (GGUF blocks: Q8_0, Q4_0/1, Q5_0/1, Q4_K, Q5_K, Q6_K), a view on the memory map:
  no float copy of it is made;
- a `RowOrdered` quantized weight: llama.cpp stores the q/k projections of `llama` models with each
  head's rows interleaved as rotary pairs; the row order maps them back to HF's rotate-half order when
  the kernels read them, instead of copying the rows.

The ops take these objects and decide how to compute with them from their format, so the decoder never
converts weights itself.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeAlias

import torch

from deterministic_inference.ops.native import native_kernels
from deterministic_inference.ops.native_build import NativeBuildError
from deterministic_inference.ops.quant import QuantizedWeight
from deterministic_inference.ops.repack import give_back_pages, stored_rows


@dataclass(frozen=True)
class RowOrdered:
    """A quantized [N, K] weight read through a row order: row i is stored row `order[i]`."""

    stored: QuantizedWeight
    order: torch.Tensor  # [N] int64, a permutation of 0..N-1

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K)."""
        return self.stored.shape


StoredWeight: TypeAlias = torch.Tensor | QuantizedWeight | RowOrdered

_DENSE_FORMATS = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


def dtype_format(dtype: torch.dtype) -> str:
    """The format name of a dense dtype: "f32", "bf16" or "f16"."""
    return _DENSE_FORMATS[dtype]


def is_quantized(weight: StoredWeight) -> bool:
    """True for block-quantized weights (with or without a row order)."""
    return not isinstance(weight, torch.Tensor)


def stored_format(weight: StoredWeight) -> str:
    """The storage format, lower case: "f32", "bf16", "f16", "q8_0", "q4_k", ..."""
    if isinstance(weight, torch.Tensor):
        return dtype_format(weight.dtype)
    return quant_part(weight)[0].fmt.name.lower()


def quant_part(weight: QuantizedWeight | RowOrdered) -> tuple[QuantizedWeight, torch.Tensor | None]:
    """(the stored blocks, the row order or None)."""
    if isinstance(weight, RowOrdered):
        return weight.stored, weight.order
    return weight, None


def dense(weight: StoredWeight, dtype: torch.dtype) -> torch.Tensor:
    """The weight as a dense `dtype` tensor in HF row order.

    Dense weights are cast (exact where the cast widens); quantized ones are dequantised bit for bit
    as `gguf.quants.dequantize` does, then cast (the compiled dequantiser, or that numpy function where
    no C compiler is available: the same bits). For bf16 the compiled dequantiser rounds each fp32 value
    itself (to nearest even, as the cast does), so no fp32 copy of the matrix is held at load."""
    if isinstance(weight, torch.Tensor):
        return weight.to(dtype)
    blocks, order = quant_part(weight)
    try:
        rounded = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
        values = blocks.dequantize(rows=order, dtype=rounded)
    except NativeBuildError:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        array = dequantize(blocks.data.numpy(), GGMLQuantizationType(blocks.fmt.ggml_type))
        array = array.reshape(blocks.shape)
        values = torch.from_numpy(array.astype("float32", copy=False))
        values = values if order is None else values[order]
    return values.to(dtype)


class Embedding:
    """Token embedding lookup: ids [T] -> rows [T, hidden] in the model dtype.

    A dense table is cast once; a quantized one stays as stored and only the looked-up rows are
    dequantised, each by itself. Why invariant: a token's row is a function of its own stored row."""

    def __init__(self, weight: StoredWeight, dtype: torch.dtype) -> None:
        self.format = dtype_format(dtype) if isinstance(weight, torch.Tensor) else stored_format(weight)
        self._lookup: Callable[[torch.Tensor], torch.Tensor]
        if isinstance(weight, torch.Tensor):
            self._lookup = weight.to(dtype).__getitem__  # rows of the [vocab, hidden] table (copies)
        else:
            self._lookup = functools.partial(_dequantized_rows, *quant_part(weight), dtype)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] int64 -> [T, hidden], a fresh tensor (the native layers update it in place)."""
        return self._lookup(ids)


def _dequantized_rows(
    blocks: QuantizedWeight, order: torch.Tensor | None, dtype: torch.dtype, ids: torch.Tensor
) -> torch.Tensor:
    """Rows `ids` of a quantized table, dequantised -> [T, hidden] in `dtype`.

    A tied table whose logits GEMM reads a repacked copy has given its file pages back; its rows are
    read back from that copy (the same bytes, so the same values). Reading them from the file's map
    instead would map the page cache's large folio around each row (~1 MB per token on a 6.18 kernel),
    which would then have to be given back after every lookup."""
    rows = (ids if order is None else order[ids]).contiguous()
    if blocks.panels is not None and order is None and len(rows):
        kernels = native_kernels()
        found = QuantizedWeight(stored_rows(kernels, blocks, rows), blocks.fmt, (len(rows), blocks.shape[1]))
        return found.dequantize(dtype=dtype, kernels=kernels)
    out = blocks.dequantize(rows=rows, dtype=dtype)
    if blocks.file_mapped and blocks.superseded:  # repacked through a row order: give the pages back
        give_back_pages(blocks.data)
    return out
