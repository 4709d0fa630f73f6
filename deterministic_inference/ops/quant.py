"""Weights kept in their GGUF block formats, and the linear that reads them in place (ops/csrc/quant*.c).

A `QuantizedWeight` is the stored bytes ([N, row_bytes] uint8, possibly a view on a memory-mapped file)
plus its format; no float copy of it is ever made. `QuantLinear` computes y = x W^T (+ b) over one or
more such weights stacked by rows (q, k, v; gate, up), each in its own format and optionally read
through a row order, in one C call. Why its rows are batch-invariant: each activation row is quantized
by itself, block by block; integer dot products are exact; and the per-block float scaling runs in
one fixed order per output (defined in csrc/quant.h), whatever M, the row's position or the thread.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deterministic_inference.errors import DetinfError
from deterministic_inference.ops.ggml_types import BLOCK_GEOMETRY, GGMLType
from deterministic_inference.ops.native import NativeKernels, native_kernels
from deterministic_inference.ops.repack import X16, repacked


@dataclass(frozen=True)
class BlockFormat:
    """A GGUF block format: `block_values` weights stored in `block_bytes` bytes."""

    name: str
    ggml_type: int
    block_values: int
    block_bytes: int


FORMATS = {  # the block formats the kernels read as stored
    kind.name: BlockFormat(kind.name, int(kind), *BLOCK_GEOMETRY[kind])
    for kind in (
        GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0,
        GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K,
    )
}  # fmt: skip
_BY_TYPE = {f.ggml_type: f for f in FORMATS.values()}
_SUPPORTED = ", ".join(FORMATS)

# test hooks of the C entry point (negative controls only; the package never passes them)
TEST_BATCH_SCALE = 1  # activation block scales from the largest |x| over all rows of the call
TEST_REVERSE = 2  # blocks in descending order (16-unit chunks)
TEST_REVERSE_ODD_THREADS = 4  # the same on odd-numbered OpenMP threads only
TEST_NO_AMX = 8  # the AVX-512 VNNI tiles where the AMX-INT8 ones would run (same bits: tests compare)
TEST_AMX_UNSIGNED = 16  # the AMX-INT8 tiles sum the unsigned weight bytes (Q4_0 / Q5_0 / Q8_0: offset lost)


class UnsupportedWeightFormat(DetinfError):
    """A tensor type the quantized kernels do not read (F32/F16/BF16 go the dense path)."""


def block_format(ggml_type: int | str) -> BlockFormat:
    """The block format of a ggml type id or name ("Q4_K"); raises UnsupportedWeightFormat otherwise."""
    found = FORMATS.get(ggml_type.upper()) if isinstance(ggml_type, str) else _BY_TYPE.get(int(ggml_type))
    if found is None:
        raise UnsupportedWeightFormat(
            f"weight format {ggml_type!r} is not a supported block format (supported: {_SUPPORTED})"
        )
    return found


class QuantizedWeight:
    """An [N, K] weight as stored: `data` uint8 [N, row_bytes], rows of `fmt` blocks; no float copy.

    `file_mapped`: `data` is a view on a model file's private map, whose pages may be given back to the
    page cache once a repacked copy replaces them (ops/repack.py); never set it for memory of its own."""

    def __init__(
        self, data: torch.Tensor, fmt: BlockFormat, shape: tuple[int, int], *, file_mapped: bool = False
    ) -> None:
        out_features, in_features = shape
        if in_features <= 0 or in_features % fmt.block_values:
            raise ValueError(
                f"{fmt.name} weight: in_features {in_features} is not a positive multiple of the "
                f"{fmt.block_values}-value block"
            )
        row_bytes = in_features // fmt.block_values * fmt.block_bytes
        if data.dtype != torch.uint8 or data.shape != (out_features, row_bytes) or out_features <= 0:
            raise ValueError(
                f"{fmt.name} weight of shape {tuple(shape)}: data must be uint8 "
                f"[{out_features}, {row_bytes}] (got {data.dtype} {list(data.shape)})"
            )
        if not data.is_contiguous():
            raise ValueError(f"{fmt.name} weight: data must be contiguous rows of blocks")
        self.data = data
        self.fmt = fmt
        self.shape = (out_features, in_features)
        self.file_mapped = file_mapped
        self.superseded = False  # a repacked copy replaced it for the GEMM (ops/repack.py)
        self.panels: torch.Tensor | None = None  # that copy, when it has the stored row order

    @property
    def row_bytes(self) -> int:
        """Bytes per stored row."""
        return int(self.data.shape[1])

    def checked_rows(self, rows: torch.Tensor, caller: str) -> torch.Tensor:
        """`rows` as contiguous [R] int64 ids of this weight's rows; ValueError naming `caller` when they
        are not 1-D int64 or one is outside [0, N) (the C code reads the rows they name unchecked)."""
        if rows.dtype != torch.int64 or rows.dim() != 1:
            raise ValueError(f"{caller}: rows must be a 1-D int64 tensor of row ids")
        rows = rows.contiguous()
        ids = rows.tolist()  # a few token ids: cheaper checked in Python than by two tensor reductions
        if ids and (min(ids) < 0 or max(ids) >= self.shape[0]):
            raise ValueError(f"{caller}: a row id is outside [0, {self.shape[0]})")
        return rows

    def dequantize(
        self,
        rows: torch.Tensor | None = None,  # [R] int64 row ids (e.g. token ids); None = every row
        dtype: torch.dtype = torch.float32,
        kernels: NativeKernels | None = None,
    ) -> torch.Tensor:
        """-> [R, K] (or [N, K]) in `dtype` (fp32, or bf16 = the fp32 value rounded to nearest even): bit
        for bit `gguf.quants.dequantize`. Elementwise, so it cannot depend on which rows are asked."""
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"dequantize: dtype must be float32 or bfloat16, not {dtype}")
        count = self.shape[0]
        if rows is not None:
            rows = self.checked_rows(rows, "dequantize")
            count = rows.numel()
        out = torch.empty((count, self.shape[1]), dtype=dtype)
        if count:
            _library(kernels or native_kernels()).detinf_dequantize(
                self.data.data_ptr(), self.row_bytes, self.fmt.ggml_type,
                None if rows is None else rows.data_ptr(), count, self.shape[1], out.data_ptr(),
                int(dtype == torch.bfloat16),
            )  # fmt: skip
        return out


def quantize_q8_0(weight: torch.Tensor, kernels: NativeKernels | None = None) -> QuantizedWeight:
    """[N, K] float weight (fp32, bf16 or fp16; K a multiple of 32) -> Q8_0, byte for byte what
    `gguf.quants.quantize(weight.float().numpy(), Q8_0)` writes."""
    if weight.dim() != 2 or weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError("quantize_q8_0: the weight must be a 2-D fp32, bf16 or fp16 tensor")
    if weight.shape[0] == 0 or weight.shape[1] == 0 or weight.shape[1] % 32:
        raise ValueError(f"quantize_q8_0: in_features {weight.shape[1]} is not a positive multiple of 32")
    if weight.dtype == torch.float16:
        weight = weight.float()  # exact
    weight = weight.contiguous()
    if not bool(torch.isfinite(weight).all()):
        raise ValueError("quantize_q8_0: the weight has infinite or NaN values")
    fmt = FORMATS["Q8_0"]
    n, k = weight.shape
    data = torch.empty((n, k // 32 * fmt.block_bytes), dtype=torch.uint8)
    _library(kernels or native_kernels()).detinf_quantize_q8_0(
        weight.data_ptr(), int(weight.dtype == torch.bfloat16), n, k, data.data_ptr()
    )
    return QuantizedWeight(data, fmt, (n, k))


class _Part(ctypes.Structure):
    """Mirror of csrc/quant.h's detinf_qpart."""

    _fields_ = [
        ("data", ctypes.c_void_p),
        ("row_order", ctypes.c_void_p),
        ("cols", ctypes.c_int64),
        ("row_bytes", ctypes.c_int64),
        ("format", ctypes.c_int64),
    ]


class QuantLinear:
    """y = x W^T (+ b), W the `parts` stacked by rows (each in its own block format), one C call.

    `row_orders[p]` (int64 [N_p], or None): output column j of part p reads stored row row_orders[p][j].
    Parts in a format this build reads faster repacked are copied once into that layout (ops/repack.py;
    the same bits).
    Bits: each output is the fixed float sequence of csrc/quant.h over its own activation row and weight
    row, so a row's result does not depend on M, its position, its neighbours or the thread count.
    """

    def __init__(
        self,
        kernels: NativeKernels,
        parts: Sequence[QuantizedWeight],
        *,
        bias: torch.Tensor | None,  # [N], any float dtype (kept as fp32)
        out_dtype: torch.dtype,
        row_orders: Sequence[torch.Tensor | None] | None = None,
        repack: bool = True,
    ) -> None:
        if not parts or not all(isinstance(part, QuantizedWeight) for part in parts):
            raise ValueError("QuantLinear: parts must be one or more QuantizedWeight")
        self.in_features = parts[0].shape[1]
        if any(part.shape[1] != self.in_features for part in parts):
            raise ValueError("QuantLinear: every part must have the same in_features")
        self.out_features = sum(part.shape[0] for part in parts)
        self.formats = tuple(part.fmt.name for part in parts)
        if out_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"QuantLinear: out_dtype must be float32 or bfloat16, not {out_dtype}")
        self.out_dtype = out_dtype
        self.bias = _checked_bias(bias, self.out_features)
        self.parts = tuple(parts)
        self.row_orders = _checked_row_orders(row_orders, self.parts)
        self._repacked: list[torch.Tensor] = []  # kept alive: the table points into them
        entries = [
            self._part_entry(kernels, part, order, repack)
            for part, order in zip(self.parts, self.row_orders, strict=True)
        ]
        self._table = (_Part * len(parts))(*entries)
        self._kernels = kernels
        self._gemm = _library(kernels).detinf_quant_gemm
        self._tiles = _library(kernels).detinf_gemm_bf16_amx_quant
        self._fit_tiles = tiles_fit(self.parts)
        self._bias_ptr = None if self.bias is None else self.bias.data_ptr()

    def _part_entry(
        self, kernels: NativeKernels, part: QuantizedWeight, order: torch.Tensor | None, repack: bool
    ) -> _Part:
        """The C table's entry for one part: repacked where this build reads the format faster so
        (`repack=False`: as stored, for tests comparing both layouts), else the stored rows."""
        data = repacked(kernels, part, order) if repack else None
        if data is not None:
            self._repacked.append(data)
            return _Part(data.data_ptr(), None, part.shape[0], part.row_bytes, part.fmt.ggml_type + X16)
        order_ptr = None if order is None else order.data_ptr()
        return _Part(part.data.data_ptr(), order_ptr, part.shape[0], part.row_bytes, part.fmt.ggml_type)

    @property
    def repacked_parts(self) -> int:
        """How many parts the GEMM reads repacked (ops/repack.py)."""
        return len(self._repacked)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] bf16 or fp32 -> [M, N] in out_dtype."""
        return self.forward_with_flags(x, 0)

    @property
    def table(self) -> ctypes.Array[_Part]:
        """The parts table the C entry point reads (ops/fused.py passes it on)."""
        return self._table

    @property
    def bias_pointer(self) -> int | None:
        """Address of the fp32 bias [N], or None."""
        return self._bias_ptr

    def forward_with_flags(self, x: torch.Tensor, flags: int) -> torch.Tensor:
        """__call__ with the C entry point's test hooks (TEST_*: negative controls in tests only)."""
        x, out = self._checked(x, (torch.bfloat16, torch.float32))
        if x.shape[0]:
            status = self._gemm(
                x.data_ptr(), x.shape[0], self.in_features, x.dtype == torch.bfloat16, self._table,
                len(self.parts), self._bias_ptr, out.data_ptr(), self.out_features,
                self.out_dtype == torch.bfloat16, flags,
            )  # fmt: skip
            if status:
                raise MemoryError("quantized GEMM could not allocate its work space")
        return out

    def on_tiles(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] bf16 -> [M, N] in out_dtype on the AMX-BF16 tiles (`--numerics native`), each panel of
        the blocks dequantised exactly (as `dequantize` does, rounded to bf16) as the GEMM reaches it: the
        bits of the AMX-BF16 GEMM on the weight dequantised to bf16 at load (ops/csrc/quant_tiles.c), with
        the blocks kept as stored. Needs parts that `tiles_fit`, and a CPU whose AMX-BF16 tiles the kernels
        can use."""
        if not self._fit_tiles:
            raise ValueError("QuantLinear.on_tiles: a part before the last is not a multiple of 16 rows")
        x, out = self._checked(x, (torch.bfloat16,))
        if x.shape[0]:
            status = self._tiles(
                x.data_ptr(), x.shape[0], self.in_features, self._table, len(self.parts), self.out_features,
                self._bias_ptr, out.data_ptr(), self.out_dtype == torch.bfloat16,
            )  # fmt: skip
            if status == 3:
                raise MemoryError("quantized GEMM on the AMX-BF16 tiles could not allocate its work space")
            if status:
                raise RuntimeError(f"quantized GEMM (native numerics): {self._kernels.native_gemm_missing()}")
        return out

    def _checked(
        self, x: torch.Tensor, dtypes: tuple[torch.dtype, ...]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x contiguous, and an empty output [M, N]; ValueError when x is not [M, K] in one of `dtypes`."""
        if x.dtype not in dtypes or x.dim() != 2 or x.shape[1] != self.in_features:
            names = " or ".join({torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype] for dtype in dtypes)
            raise ValueError(
                f"QuantLinear: x must be {names} [M, {self.in_features}], got {x.dtype} {list(x.shape)}"
            )
        return x.contiguous(), torch.empty((x.shape[0], self.out_features), dtype=self.out_dtype)


def tiles_fit(parts: Sequence[QuantizedWeight]) -> bool:
    """Whether `QuantLinear.on_tiles` can read these stacked parts: every part but the last a multiple of 16
    rows (so that no 16-column block of the AMX-BF16 GEMM spans two parts) and K a multiple of 32."""
    return all(part.shape[0] % 16 == 0 for part in parts[:-1]) and parts[0].shape[1] % 32 == 0


def uses_amx(kernels: NativeKernels) -> bool:
    """True when these kernels run calls of 16 rows or more of the 32-value formats on AMX-INT8 tiles
    (the CPU has them, the build was made for it and the OS granted them); speed only, same bits."""
    return bool(_library(kernels).detinf_quant_uses_amx())


def _checked_bias(bias: torch.Tensor | None, out_features: int) -> torch.Tensor | None:
    if bias is None:
        return None
    if bias.shape != (out_features,) or not bias.is_floating_point():
        raise ValueError(f"QuantLinear: bias must be a float tensor of shape [{out_features}]")
    return bias.float().contiguous()


def _checked_row_orders(
    row_orders: Sequence[torch.Tensor | None] | None, parts: tuple[QuantizedWeight, ...]
) -> tuple[torch.Tensor | None, ...]:
    """Each order int64 [N_p] with values in [0, N_p): the C code reads rows through it unchecked."""
    if row_orders is None:
        return (None,) * len(parts)
    if len(row_orders) != len(parts):
        raise ValueError(f"QuantLinear: {len(row_orders)} row orders for {len(parts)} parts")
    checked = []
    for index, (order, part) in enumerate(zip(row_orders, parts, strict=True)):
        rows = part.shape[0]
        if order is not None:
            if order.dtype != torch.int64 or order.shape != (rows,):
                raise ValueError(f"QuantLinear: row order {index} must be int64 of shape [{rows}]")
            order = order.contiguous()
            if int(order.min()) < 0 or int(order.max()) >= rows:
                raise ValueError(f"QuantLinear: row order {index} has a row outside [0, {rows})")
        checked.append(order)
    return tuple(checked)


@functools.cache
def _library(kernels: NativeKernels) -> ctypes.CDLL:
    """The kernels' library with the quantized entry points' C signatures declared (once per build)."""
    library = kernels.library
    pointer, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    library.detinf_quant_gemm.restype = c_int
    library.detinf_quant_gemm.argtypes = [
        pointer,
        i64,
        i64,
        c_int,
        pointer,
        i64,
        pointer,
        pointer,
        i64,
        c_int,
        c_int,
    ]
    library.detinf_gemm_bf16_amx_quant.restype = c_int
    library.detinf_gemm_bf16_amx_quant.argtypes = [
        pointer, i64, i64, pointer, i64, i64, pointer, pointer, c_int
    ]  # fmt: skip
    library.detinf_quant_uses_amx.restype = c_int
    library.detinf_quant_uses_amx.argtypes = []
    library.detinf_dequantize.restype = None
    library.detinf_dequantize.argtypes = [pointer, i64, i64, pointer, i64, i64, pointer, c_int]
    library.detinf_quantize_q8_0.restype = None
    library.detinf_quantize_q8_0.argtypes = [pointer, c_int, i64, i64, pointer]
    return library
