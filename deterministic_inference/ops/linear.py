"""Linear layers whose rows do not depend on how many other rows share the GEMM call."""

from __future__ import annotations

import torch
import torch.nn.functional as F

BACKENDS = ("mkldnn", "aten")


def padded_rows(num_rows: int, tile_rows: int) -> int:
    """Row count the GEMM is called with: a multiple of `tile_rows`, at least `tile_rows`."""
    return max(tile_rows, -(-num_rows // tile_rows) * tile_rows)


def pad_rows(x: torch.Tensor, tile_rows: int) -> torch.Tensor:
    """x: [M, K] -> [P, K] with zero rows appended so P = padded_rows(M, tile_rows)."""
    num_rows = x.shape[0]
    target = padded_rows(num_rows, tile_rows)
    if target == num_rows:
        return x.contiguous()
    out = x.new_zeros((target, x.shape[1]))
    out[:num_rows] = x
    return out


def mkldnn_available(dtype: torch.dtype) -> bool:
    """True when torch exposes the oneDNN prepacked linear ops for this dtype."""
    ops = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
        and dtype in (torch.float32, torch.bfloat16)
    )


class Linear:
    """y = x W^T (+ b), with every GEMM call made on a padded, fixed-granularity row count.

    Why invariant: oneDNN and MKL pick their kernels and their reduction order from the GEMM's shape.
    Padding the row count to a multiple of `tile_rows` (at least `tile_rows` rows) keeps every call in
    the same kernel class, and each output row is then a fixed-order dot product of its own input row
    with W, whatever the other rows are and wherever the row sits. The start-up self-check proves this
    per machine at the model's shapes. With `batch_invariant=False` it is plain `F.linear`.
    """

    def __init__(
        self,
        weight: torch.Tensor,  # [out_features, in_features]
        bias: torch.Tensor | None,  # [out_features]
        *,
        tile_rows: int,
        batch_invariant: bool,
        backend: str = "mkldnn",
    ) -> None:
        self.weight = weight.contiguous()
        self.bias = None if bias is None else bias.contiguous()
        self.tile_rows = tile_rows
        self.batch_invariant = batch_invariant
        self.out_features, self.in_features = self.weight.shape
        use_mkldnn = backend == "mkldnn" and batch_invariant and mkldnn_available(weight.dtype)
        self.backend = "mkldnn" if use_mkldnn else "aten"
        self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, None) if use_mkldnn else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [M, in] -> [M, out]."""
        if not self.batch_invariant:
            return F.linear(x, self.weight, self.bias)
        num_rows = x.shape[0]
        x_padded = pad_rows(x, self.tile_rows)  # [P, in]
        if self._packed is not None:
            out = torch.ops.mkldnn._linear_pointwise(x_padded, self._packed, self.bias, "none", [], "")
        else:
            out = F.linear(x_padded, self.weight, self.bias)
        return out[:num_rows]
