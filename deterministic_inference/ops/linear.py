"""Linear layers whose rows do not depend on how many other rows share the GEMM call."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeAlias

import torch
import torch.nn.functional as F

from deterministic_inference.ops.portable import gemm_f32, pack_f32
from deterministic_inference.ops.quant import QuantizedWeight, QuantLinear, tiles_fit
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
    A batch-invariant linear needs the kernels: torch's GEMMs (oneDNN, MKL) pick their kernel and reduction
    order from the call's shape and the CPU (padding the row count to a multiple of a tile once stood in
    for that; oneDNN's AMX kernels broke it at M = 33), so they are used only with `batch_invariant=False`,
    as plain `F.linear` (the negative-control backend).

    `out_dtype` (default: `dtype`) may be fp32 for bf16 weights: the native GEMM then returns its
    fp32 sums unrounded (the logits head); the other backends compute in fp32 on an fp32 copy of W.

    `native_gemm` (`--numerics native`): a bf16 linear's GEMM runs on the CPU's AMX-BF16 tiles
    (ops/csrc/gemm_amx.h) on the same packed weight: still invariant in the row count, the row's
    position and the thread count, but with bits fixed per CPU class, not by our source. With `dtype`
    bf16, quantized parts run on the tiles too, as bf16 weights: the blocks stay as stored and the GEMM
    dequantises each panel (exactly, as `dense` does, rounded to bf16 once) as it reaches it
    (`QuantLinear.on_tiles`, ops/csrc/quant_tiles.c), with the bits of dequantising at load; parts that
    would split one of its 16-column blocks (a part before the last whose rows are not a multiple of 16)
    are dequantised here instead, with the same bits. fp32 linears are unaffected.
    """

    def __init__(
        self,
        weight: LinearWeight,  # [out_features, in_features], or parts stacked by rows
        bias: torch.Tensor | None,  # [out_features]
        *,
        batch_invariant: bool,
        kernels: NativeKernels | None = None,
        out_dtype: torch.dtype | None = None,
        dtype: torch.dtype | None = None,
        native_gemm: bool = False,
    ) -> None:
        self.native_gemm = False  # True once a dense bf16 weight runs on the AMX-BF16 GEMM
        parts = [weight] if isinstance(weight, (torch.Tensor, QuantizedWeight, RowOrdered)) else list(weight)
        first = parts[0]
        dtype = dtype or (first.dtype if isinstance(first, torch.Tensor) else torch.float32)
        self.out_dtype = out_dtype or dtype
        self.batch_invariant = batch_invariant
        bias = None if bias is None else bias.to(dtype)
        self._native: tuple[NativeKernels, torch.Tensor, torch.Tensor | None] | None = None
        self._native_f32: tuple[NativeKernels, torch.Tensor, torch.Tensor | None] | None = None
        self._quant: QuantLinear | None = None
        self._quant_tiles: QuantLinear | None = None  # native numerics: blocks dequantised into the tiles
        # Native numerics on a bf16 model: quantized parts run on the tiles as bf16 (dequantised exactly).
        tiles = native_gemm and dtype == torch.bfloat16
        quantized = all(is_quantized(part) for part in parts)
        blocks = [quant_part(part) for part in parts] if quantized else []  # type: ignore[arg-type]
        stored, orders = [b for b, _ in blocks], [order for _, order in blocks]
        # parts that would split a 16-column block of the tiles are dequantised below instead
        if kernels is not None and batch_invariant and quantized and (not tiles or tiles_fit(stored)):
            quant = QuantLinear(kernels, stored, bias=bias, out_dtype=self.out_dtype, row_orders=orders)
            self.out_features, self.in_features = quant.out_features, quant.in_features
            if tiles:
                self._quant_tiles, self.backend, self.native_gemm = quant, "native", True
                self.formats = (dtype_format(dtype),) * len(parts)  # the tiles' arithmetic: bf16 weights
            else:
                self._quant, self.backend = quant, "quant"
                self.formats = tuple(stored_format(part) for part in parts)
            return
        # Dense: every part cast (quantized parts dequantised: the plain backend, or a linear mixing
        # quantized and float parts) and stacked.
        self.formats = (dtype_format(dtype),) * len(parts)
        self._init_dense(_stack([dense(part, dtype) for part in parts]), bias, dtype, kernels, native_gemm)

    def _init_dense(
        self,
        weight: torch.Tensor,  # [N, K] in dtype
        bias: torch.Tensor | None,  # [N] in dtype
        dtype: torch.dtype,
        kernels: NativeKernels | None,
        native_gemm: bool,
    ) -> None:
        self.out_features, self.in_features = weight.shape
        if kernels is not None and self.batch_invariant and dtype == torch.bfloat16:
            # native path: the kernels, the packed weight [ceil(N/16) * ceil(K/2) * 32] and the fp32 bias
            self.backend = "native"
            bias32 = None if bias is None else bias.float().contiguous()
            self._native = (kernels, kernels.pack_bf16(weight.contiguous()), bias32)
            self.native_gemm = native_gemm
            return
        if kernels is not None and self.batch_invariant and dtype == torch.float32:
            # portable fp32 path: the packed weight [ceil(N/16) * K * 16] and the fp32 bias
            self.backend = "native_f32"
            bias32 = None if bias is None else bias.float().contiguous()
            self._native_f32 = (kernels, pack_f32(kernels, weight), bias32)
            return
        if self.batch_invariant:
            raise ValueError(
                f"a batch-invariant {dtype_format(dtype)} linear runs on the compiled kernels: pass `kernels`"
                " (ops/native.py), or batch_invariant=False for plain F.linear"
            )
        self.weight = weight.to(self.out_dtype).contiguous()
        self.bias = None if bias is None else bias.to(self.out_dtype).contiguous()
        self.backend = "aten"

    @property
    def quant_linear(self) -> QuantLinear | None:
        """The quantized GEMM this linear runs on (backend "quant"), else None."""
        return self._quant

    @property
    def quant_tiles(self) -> QuantLinear | None:
        """The quantized weight native numerics dequantises into the AMX-BF16 tiles, else None."""
        return self._quant_tiles

    @property
    def native_weight(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """(packed bf16 weight, fp32 bias or None) of the native bf16 GEMM (backend "native"), else None."""
        return None if self._native is None else self._native[1:]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [M, in] -> [M, out] in `out_dtype`."""
        if self._quant is not None:
            return self._quant(x)
        if self._quant_tiles is not None:
            return self._quant_tiles.on_tiles(x)
        if self._native is not None:
            kernels, packed, bias32 = self._native
            return kernels.gemm_bf16(
                x.contiguous(), packed, self.out_features, bias32, self.out_dtype, native=self.native_gemm
            )
        if self._native_f32 is not None:
            kernels, packed, bias32 = self._native_f32
            return gemm_f32(kernels, x, packed, self.out_features, bias32)
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias)


def _stack(parts: list[torch.Tensor]) -> torch.Tensor:
    """Dense parts [N_i, K] -> [sum N_i, K] (no copy for a single part)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)
