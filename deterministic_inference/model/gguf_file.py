"""A GGUF file's header (metadata and tensor directory) and its tensors as views on a memory map.

The `gguf` package's reader builds numpy objects for every element of every metadata array (a 49k-token
vocabulary and its merges: ~160 MB of Python objects at load); this reader decodes the header straight
into Python values and maps the file once (copy-on-write: the views are writable, the file is never
written), so loading costs the tokenizer's strings and the pages the model touches.

Layout (GGUF v2/v3, little endian): magic "GGUF", u32 version, u64 tensor count, u64 key/value count;
key/value pairs (string key, u32 value type, value); tensor infos (string name, u32 dims, u64 dims[],
u32 ggml type, u64 offset); then the data section at the next multiple of `general.alignment` (32).
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

import numpy as np
import torch

from deterministic_inference.ops.ggml_types import BLOCK_GEOMETRY, GGMLType
from deterministic_inference.ops.repack import give_back_pages

MAGIC = b"GGUF"
_SCALARS = {  # GGUF value type -> struct format
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d",
}  # fmt: skip
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<?", 10: "<u8",
          11: "<i8", 12: "<f8"}  # fmt: skip
_STRING, _ARRAY = 8, 9
_DENSE = {GGMLType.F32: np.float32, GGMLType.F16: np.float16}


def metadata_float(meta: dict[str, Any], key: str, default: float) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-05, not 9.99999974e-06;
    0.1 not 0.100000001), so a GGUF spec equals the HF one; float32 arithmetic sees the same bits."""
    return float(str(np.float32(meta.get(key, default))))


class GGUFFormatError(ValueError):
    """The bytes are not a well-formed GGUF file (corrupt or truncated)."""


def _decoded(buffer: mmap.mmap, start: int, size: int) -> str:
    """The GGUF string of `size` bytes at `start` (UTF-8; a bad byte becomes U+FFFD, never an error)."""
    return buffer[start : start + size].decode("utf-8", errors="replace")


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file: `data` is a view on the map (F32/F16: typed [rows..., cols]; any other
    type: raw bytes uint8 [rows..., row_bytes])."""

    name: str
    tensor_type: GGMLType
    shape: tuple[int, ...]  # numpy order (the file's dims reversed)
    data: np.ndarray


class StringArray(Sequence[str]):
    """A metadata array of strings, decoded from the map each time it is read.

    A vocabulary and its merges are ~100k strings. Decoded at parse time they would live as long as the
    metadata, while the load allocates the objects that outlive it (tensor views, the tokenizer's
    tables) in between them; freed, they would then leave ~9 MiB of Python's object arenas pinned for
    the process's life. Read in one pass where they are used (`build_gguf_tokenizer`), they are freed
    together."""

    def __init__(self, buffer: mmap.mmap, starts: np.ndarray, sizes: np.ndarray) -> None:
        self._buffer = buffer
        self._starts, self._sizes = starts, sizes  # int64 [count] byte offsets and lengths in the map

    def __len__(self) -> int:
        return int(self._sizes.shape[0])

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> list[str]: ...

    def __getitem__(self, index: int | slice) -> str | list[str]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return _decoded(self._buffer, int(self._starts[index]), int(self._sizes[index]))

    def __iter__(self) -> Iterator[str]:
        buffer = self._buffer
        for start, size in zip(self._starts.tolist(), self._sizes.tolist(), strict=True):
            yield _decoded(buffer, start, size)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StringArray | list | tuple):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"StringArray({len(self)} strings)"


@dataclass(frozen=True)
class GGUFFile:
    """Metadata (numeric arrays as lists, string arrays as `StringArray`) and tensors of a GGUF file."""

    metadata: dict[str, Any]
    tensors: tuple[GGUFTensor, ...]
    buffer: mmap.mmap  # the file's private map
    header_bytes: int  # where the data section starts

    def release_header(self) -> None:
        """Give the header's whole pages back to the OS once the load has read what it needs (a 49k
        vocabulary and its merges are ~2 MB of it). The map is never written there, so a later read of
        the metadata faults the same bytes back in from the file."""
        give_back_pages(torch.from_numpy(np.frombuffer(self.buffer, np.uint8, count=self.header_bytes)))


class _Cursor:
    """Reads little-endian values from the mapped header, refusing to run past the end."""

    def __init__(self, buffer: mmap.mmap) -> None:
        self.buffer, self.offset = buffer, 0

    def take(self, size: int) -> int:
        start = self.offset
        if size < 0 or start + size > len(self.buffer):
            raise GGUFFormatError(f"the header runs past the end of the file at byte {start}")
        self.offset += size
        return start

    def scalar(self, kind: int) -> Any:
        layout = _SCALARS[kind]
        return struct.unpack_from(layout, self.buffer, self.take(struct.calcsize(layout)))[0]

    def string(self) -> str:
        size = self.scalar(10)
        return _decoded(self.buffer, self.take(size), size)

    def strings(self, count: int) -> StringArray:
        """`count` strings in a row (a vocabulary: one tight loop, no call per item), located and
        bounds-checked now, decoded when read."""
        buffer, offset, end = self.buffer, self.offset, len(self.buffer)
        unpack = struct.Struct("<Q").unpack_from
        starts, sizes = np.empty(count, np.int64), np.empty(count, np.int64)
        for index in range(count):
            if offset + 8 > end:
                raise GGUFFormatError(f"a string array runs past the end of the file at byte {offset}")
            (size,) = unpack(buffer, offset)
            offset += 8
            if offset + size > end:
                raise GGUFFormatError(f"a string array runs past the end of the file at byte {offset}")
            starts[index], sizes[index] = offset, size
            offset += size
        self.offset = offset
        return StringArray(buffer, starts, sizes)

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item_kind, count = self.scalar(4), self.scalar(10)
            if item_kind in _NUMPY:
                dtype = np.dtype(_NUMPY[item_kind])
                start = self.take(count * dtype.itemsize)
                return np.frombuffer(self.buffer, dtype, count, start).tolist()
            if item_kind == _STRING:
                return self.strings(count)
            return [self.value(item_kind) for _ in range(count)]
        if kind not in _SCALARS:
            raise GGUFFormatError(f"unknown metadata value type {kind} at byte {self.offset}")
        return self.scalar(kind)


def read_gguf(path: Path) -> GGUFFile:
    """Parse the header and map the tensors. Raises GGUFFormatError on malformed or truncated bytes."""
    with open(path, "rb") as handle:
        buffer = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
    cursor = _Cursor(buffer)
    if bytes(buffer[cursor.take(4) : 4]) != MAGIC:
        raise GGUFFormatError("no GGUF magic bytes")
    version = cursor.scalar(4)
    if version not in (2, 3):
        raise GGUFFormatError(f"GGUF version {version} is not supported (2 or 3)")
    tensor_count, kv_count = cursor.scalar(10), cursor.scalar(10)
    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.scalar(4))
    infos = [_tensor_info(cursor) for _ in range(tensor_count)]
    alignment = int(metadata.get("general.alignment", 32))
    data_start = -(-cursor.offset // alignment) * alignment
    whole = np.frombuffer(buffer, np.uint8)  # keeps the map alive while any view lives
    tensors = tuple(_tensor(whole, data_start, *info) for info in infos)
    return GGUFFile(metadata, tensors, buffer, data_start)


def _tensor_info(cursor: _Cursor) -> tuple[str, tuple[int, ...], GGMLType, int]:
    name = cursor.string()
    dims = tuple(cursor.scalar(10) for _ in range(cursor.scalar(4)))
    kind, offset = cursor.scalar(4), cursor.scalar(10)
    try:
        ggml_type = GGMLType(kind)
    except ValueError:
        raise GGUFFormatError(f"tensor {name} has an unknown type id {kind}") from None
    return name, tuple(reversed(dims)), ggml_type, offset


def _tensor(
    whole: np.ndarray,  # the whole file, uint8
    data_start: int,
    name: str,
    shape: tuple[int, ...],
    kind: GGMLType,
    offset: int,  # from the data section's start
) -> GGUFTensor:
    block_values, block_bytes = BLOCK_GEOMETRY[kind]
    if not shape or shape[-1] % block_values:
        raise GGUFFormatError(f"tensor {name}: {shape[-1:]} values per row is not whole {kind.name} blocks")
    row_bytes = shape[-1] // block_values * block_bytes
    size = int(np.prod(shape[:-1], dtype=np.int64)) * row_bytes
    start = data_start + offset
    if start + size > whole.shape[0]:
        raise GGUFFormatError(f"tensor {name} runs past the end of the file")
    raw = whole[start : start + size]
    if kind in _DENSE:
        return GGUFTensor(name, kind, shape, raw.view(_DENSE[kind]).reshape(shape))
    return GGUFTensor(name, kind, shape, raw.reshape(*shape[:-1], row_bytes))
