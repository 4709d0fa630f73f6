"""Quantized weights repacked once at load for the kernels that read them faster so (csrc/quant_repack.c).

Which formats a build repacks is the compiled library's own answer (`detinf_quant_repacks`: Q4_0,
Q4_1, Q8_0, Q4_K, Q5_K and Q6_K on AVX-512 builds, whose GEMM otherwise transposes 16 rows' blocks on
every call), so the layout a GEMM reads always matches the code reading it. Repacking moves integers
only: every output keeps the bits of the stored layout, which builds that do not repack read
(csrc/quant_repack.c says why).

Memory: the repacked copy is as large as the stored tensor. When the stored tensor is a view on the
model file's private map, its pages are given back (MADV_DONTNEED) chunk by chunk as they are repacked,
so resident memory stays near the file size. Nothing writes that map, so a page given back still reads
as the file's bytes. The embedding lookup of a tied output head reads its rows back from the repacked
copy (`stored_rows`) instead, so those pages stay given back.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from deterministic_inference.ops.native import NativeKernels

if TYPE_CHECKING:
    from deterministic_inference.ops.quant import QuantizedWeight

X16 = 100  # csrc/quant.h: a repacked format's id is its ggml type id + X16 (16-column panels)
PANEL_COLUMNS = 16
_CHUNK_BYTES = 1 << 20  # stored bytes repacked between two page releases (whole 16-column panels)


def repacked(
    kernels: NativeKernels,
    weight: QuantizedWeight,
    order: torch.Tensor | None,  # [N] int64: output column j reads stored row order[j]; None = identity
) -> torch.Tensor | None:
    """The weight in the layout this build reads faster (uint8, as large as `weight.data`; output
    columns in order, so no row order is needed any more), or None when the build reads it as stored.
    A file-mapped weight's pages are given back as they are repacked."""
    library = _library(kernels)
    rows, row_bytes, fmt = weight.shape[0], weight.row_bytes, weight.fmt.ggml_type
    if rows % PANEL_COLUMNS or not library.detinf_quant_repacks(fmt):
        return None
    out = _huge_page_buffer(weight.data.numel()).view(weight.data.shape)  # N / 16 panels of 16 * row_bytes
    order_ptr = None if order is None else order.data_ptr()
    # the stored pages a chunk faulted in stay resident until it is given back: on top of the model
    chunk = max(PANEL_COLUMNS, _CHUNK_BYTES // row_bytes // PANEL_COLUMNS * PANEL_COLUMNS)
    for first in range(0, rows, chunk):
        count = min(chunk, rows - first)
        library.detinf_repack(fmt, weight.data.data_ptr(), order_ptr, row_bytes, first, count, out.data_ptr())
        if weight.file_mapped and order is None:  # these stored rows are read by nothing else now
            give_back_pages(weight.data[first : first + count])
    if weight.file_mapped:
        give_back_pages(weight.data)
        weight.superseded = True  # give_back_superseded gives its pages back again (per layer, at the end)
        if order is None:
            weight.panels = out  # a tied embedding reads its rows from here (stored_rows)
    return out


def stored_rows(kernels: NativeKernels, weight: QuantizedWeight, rows: torch.Tensor) -> torch.Tensor:
    """uint8 [R, row_bytes]: stored rows `rows` ([R] int64) of a weight whose repacked copy
    (`weight.panels`) replaced it, read back from that copy: the same bytes, so the same values when
    dequantised, without faulting the file's pages back in (and giving them back) for every lookup."""
    panels = weight.panels
    if panels is None:
        raise ValueError("stored_rows: the weight has no repacked copy to read")
    rows = weight.checked_rows(rows, "stored_rows")
    out = torch.empty((rows.numel(), weight.row_bytes), dtype=torch.uint8)
    _library(kernels).detinf_unrepack_rows(
        weight.fmt.ggml_type, panels.data_ptr(), weight.row_bytes, rows.data_ptr(), rows.numel(),
        out.data_ptr(),
    )  # fmt: skip
    return out


def give_back_superseded(weights: Iterable[object]) -> None:
    """After each decoder layer and once every linear is built: give back again the pages of every
    file-mapped weight a repacked copy replaced (StoredWeights, or tuples of them for expert stacks).
    Faulting in the next tensor maps the page cache's large folios whole, so pages of tensors repacked
    before come back (a 1B Q4_0 file: ~15 MB on one kernel, ~60 MB on a newer one when given back only
    at the end)."""
    from deterministic_inference.ops.quant import QuantizedWeight  # (quant.py imports this module)

    for weight in weights:
        if isinstance(weight, tuple | list):
            give_back_superseded(weight)
            continue
        stored = getattr(weight, "stored", weight)  # a RowOrdered's blocks
        if isinstance(stored, QuantizedWeight) and stored.superseded:
            give_back_pages(stored.data)


def _huge_page_buffer(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes] of fresh anonymous memory the kernel may back with 2 MiB pages (THP in `madvise`
    mode): one thread streaming a GEMV from it reads ~10% faster than from 4 KiB pages (fewer TLB misses).
    Only whole 2 MiB ranges inside it become huge pages, so no more memory is resident than with 4 KiB."""
    size = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(region, dtype=torch.uint8, count=nbytes)  # the tensor keeps the map alive


def give_back_pages(view: torch.Tensor) -> None:
    """Drop the whole pages under a contiguous view on a file's private, never-written map from this
    process's resident set (the bytes stay readable: a later read faults them back in from the file)."""
    start = view.data_ptr()
    end = start + view.numel() * view.element_size()
    first_page = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    last_page = end // mmap.PAGESIZE * mmap.PAGESIZE
    if last_page > first_page:
        _libc().madvise(first_page, last_page - first_page, mmap.MADV_DONTNEED)


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.restype = ctypes.c_int
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


@functools.cache
def _library(kernels: NativeKernels) -> ctypes.CDLL:
    """The kernels' library with the repacking entry points' C signatures declared (once per build)."""
    library = kernels.library
    library.detinf_quant_repacks.restype = ctypes.c_int
    library.detinf_quant_repacks.argtypes = [ctypes.c_int64]
    library.detinf_repack.restype = None
    library.detinf_repack.argtypes = [
        ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
        ctypes.c_void_p,
    ]  # fmt: skip
    library.detinf_unrepack_rows.restype = None
    library.detinf_unrepack_rows.argtypes = [
        ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p
    ]  # fmt: skip
    return library
