"""Linear layers whose rows do not depend on how many other rows share the GEMM call."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeAlias

import torch
import torch.nn.functional as F

from deterministic_inference.ops.portable import gemm_f32, pack_f32
from deterministic_inference.ops.quant import QuantizedWeight, QuantLinear
from deterministic_inference.ops.weights import (
    RowOrdered,
    StoredWeight,
    dense,
    dtype_format,
    is_quantized,
    quant_part,
    stored_format,
)

if TYPE_CHECKING:
    from deterministic_inference.ops.native import NativeKernels


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


LinearWeight: TypeAlias = StoredWeight | Sequence[StoredWeight]  # one matrix, or several stacked by rows


class Linear:
    """y = x W^T (+ b) whose rows do not depend on how many other rows share the call.

    `weight` is one stored matrix [out, in] or several stacked by rows (q, k and v; gate and up): the
    linear computes as if they were one matrix. Dense weights are cast to `dtype` (default: the first
    part's dtype) when the linear is built; quantized weights stay as stored when every part is
    quantized and the compiled kernels run, else they are dequantised to `dtype` here (the plain
    backend; a linear mixing quantized and float parts).

    Why invariant: quantized weights with the compiled kernels (backend "quant", `ops/quant.py`)
    quantize each activation row by itself and sum exact integer products, scaled in a fixed order per
    output. For dense bf16 weights with the compiled kernels (`kernels`, backend "native") every output
    is a fixed-order fp32 sum over its own row and column (ops/csrc/gemm.c), so no padding is needed;
    for dense fp32 weights (backend "native_f32") a fixed chain of fused multiply-adds per output
    (ops/csrc/gemm_f32.c): in both, the bits do not depend on the CPU's ISA either (portable numerics).
    Otherwise (no kernels: tests of the padded GEMMs) oneDNN or MKL is called on a padded row count: they pick
    their kernel and reduction order from the GEMM's shape, and padding to a multiple of `tile_rows`
    (at least `tile_rows` rows) keeps every call in the same kernel class, so each row is a fixed-order
    dot product of its own input with W. The start-up self-check proves either per machine at the
    model's shapes. With `batch_invariant=False` it is plain `F.linear`.

    `out_dtype` (default: `dtype`) may be fp32 for bf16 weights: the native GEMM then returns its
    fp32 sums unrounded (the logits head); the other backends compute in fp32 on an fp32 copy of W.
    """

    def __init__(
        self,
        weight: LinearWeight,  # [out_features, in_features], or parts stacked by rows
        bias: torch.Tensor | None,  # [out_features]
        *,
        tile_rows: int,
        batch_invariant: bool,
        backend: str = "mkldnn",
        kernels: NativeKernels | None = None,
        out_dtype: torch.dtype | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        parts = [weight] if isinstance(weight, (torch.Tensor, QuantizedWeight, RowOrdered)) else list(weight)
        first = parts[0]
        dtype = dtype or (first.dtype if isinstance(first, torch.Tensor) else torch.float32)
        self.out_dtype = out_dtype or dtype
        self.tile_rows = tile_rows
        self.batch_invariant = batch_invariant
        bias = None if bias is None else bias.to(dtype)
        self._native: tuple[NativeKernels, torch.Tensor, torch.Tensor | None] | None = None
        self._native_f32: tuple[NativeKernels, torch.Tensor, torch.Tensor | None] | None = None
        self._quant: QuantLinear | None = None
        if kernels is not None and batch_invariant and all(is_quantized(part) for part in parts):
            blocks = [quant_part(part) for part in parts]  # type: ignore[arg-type]
            self._quant = QuantLinear(
                kernels, [b for b, _ in blocks], bias=bias, out_dtype=self.out_dtype,
                row_orders=[order for _, order in blocks],
            )  # fmt: skip
            self.backend = "quant"
            self.formats = tuple(stored_format(part) for part in parts)
            self.out_features, self.in_features = self._quant.out_features, self._quant.in_features
            return
        # Dense: every part cast (quantized parts dequantised: the plain backend, or a linear mixing
        # quantized and float parts) and stacked.
        self.formats = (dtype_format(dtype),) * len(parts)
        self._init_dense(_stack([dense(part, dtype) for part in parts]), bias, dtype, kernels, backend)

    def _init_dense(
        self,
        weight: torch.Tensor,  # [N, K] in dtype
        bias: torch.Tensor | None,  # [N] in dtype
        dtype: torch.dtype,
        kernels: NativeKernels | None,
        backend: str,
    ) -> None:
        self.out_features, self.in_features = weight.shape
        if kernels is not None and self.batch_invariant and dtype == torch.bfloat16:
            # native path: the kernels, the packed weight [ceil(N/16) * ceil(K/2) * 32] and the fp32 bias
            self.backend = "native"
            bias32 = None if bias is None else bias.float().contiguous()
            self._native = (kernels, kernels.pack_bf16(weight.contiguous()), bias32)
            return
        if kernels is not None and self.batch_invariant and dtype == torch.float32:
            # portable fp32 path: the packed weight [ceil(N/16) * K * 16] and the fp32 bias
            self.backend = "native_f32"
            bias32 = None if bias is None else bias.float().contiguous()
            self._native_f32 = (kernels, pack_f32(kernels, weight), bias32)
            return
        self.weight = weight.to(self.out_dtype).contiguous()
        self.bias = None if bias is None else bias.to(self.out_dtype).contiguous()
        use_mkldnn = backend == "mkldnn" and self.batch_invariant and mkldnn_available(self.weight.dtype)
        self.backend = "mkldnn" if use_mkldnn else "aten"
        self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, None) if use_mkldnn else None

    @property
    def quant_linear(self) -> QuantLinear | None:
        """The quantized GEMM this linear runs on (backend "quant"), else None."""
        return self._quant

    @property
    def native_weight(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """(packed bf16 weight, fp32 bias or None) of the native bf16 GEMM (backend "native"), else None."""
        return None if self._native is None else self._native[1:]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [M, in] -> [M, out] in `out_dtype`."""
        if self._quant is not None:
            return self._quant(x)
        if self._native is not None:
            kernels, packed, bias32 = self._native
            return kernels.gemm_bf16(x.contiguous(), packed, self.out_features, bias32, self.out_dtype)
        if self._native_f32 is not None:
            kernels, packed, bias32 = self._native_f32
            return gemm_f32(kernels, x, packed, self.out_features, bias32)
        x = x.to(self.weight.dtype)
        if not self.batch_invariant:
            return F.linear(x, self.weight, self.bias)
        num_rows = x.shape[0]
        x_padded = pad_rows(x, self.tile_rows)  # [P, in]
        if self._packed is not None:
            out = torch.ops.mkldnn._linear_pointwise(x_padded, self._packed, self.bias, "none", [], "")
        else:
            out = F.linear(x_padded, self.weight, self.bias)
        return out[:num_rows]


def _stack(parts: list[torch.Tensor]) -> torch.Tensor:
    """Dense parts [N_i, K] -> [sum N_i, K] (no copy for a single part)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)
