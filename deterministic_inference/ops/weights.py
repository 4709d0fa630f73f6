"""Weights as the loaders hand them out, and the embedding lookup over them.

A `StoredWeight` is one named tensor of a model: today a dense float tensor (fp32, bf16). The ops take
these objects and decide how to compute with them from their format (`weight_format`), so the decoder
never converts weights itself.
"""

from __future__ import annotations

import torch

StoredWeight = torch.Tensor  # [rows, cols] dense

_DENSE_FORMATS = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


def dtype_format(dtype: torch.dtype) -> str:
    """The format name of a dense dtype: "f32", "bf16" or "f16"."""
    return _DENSE_FORMATS[dtype]


def dense(weight: StoredWeight, dtype: torch.dtype) -> torch.Tensor:
    """The weight as a dense `dtype` tensor (a cast: exact for the formats it widens)."""
    return weight.to(dtype)


class Embedding:
    """Token embedding lookup: ids [T] -> rows [T, hidden] in the model dtype.

    Why invariant: a row copy of the token's own stored row; nothing is summed."""

    def __init__(self, weight: StoredWeight, dtype: torch.dtype) -> None:
        self.table = dense(weight, dtype)  # [vocab, hidden]

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] int64 -> [T, hidden], a fresh tensor (the native layers update it in place)."""
        return self.table[ids]
