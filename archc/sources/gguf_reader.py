"""A GGUF file's metadata and tensor table, read with plain file reads, and each tensor's stored
bytes mapped only while it is read.

The layout (little-endian; version 2 and 3): the magic ``GGUF``, the version (u32), the tensor
and metadata counts (u64 each); the metadata, each a key string, a value type (u32) and the
value; the tensor table, each a name, its dims (u32 count, u64 each, innermost first), its GGML
type (u32) and its offset (u64) from the data section, which starts at the next multiple of
`general.alignment` (32 by default). A string is a u64 length and UTF-8 bytes; an array, an
element type (u32), a count (u64) and the elements.

The metadata is parsed into plain Python values, but for its long arrays (a tokenizer's
vocabulary), read only when asked for; no tensor byte is touched until a tensor is read, and then
only that tensor's bytes are mapped: a whole file is never resident at once."""

from __future__ import annotations

import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from archc.errors import WeightsError

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# value type → struct format of one element (8: string, 9: array, read apart)
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
           12: "d"}
STRING, ARRAY = 8, 9
DEFERRED = 1024       # arrays longer than this are read when asked for (`Metadata`)
# GGML types held as arrays of their own element type (the rest as bytes: blocks, BF16)
ELEMENTS = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8,
            "I16": np.int16, "I32": np.int32, "I64": np.int64}


class _Truncated(Exception):
    """The file ended inside the metadata or the tensor table."""


class _Cursor:
    """Little-endian values read in order from a file."""

    def __init__(self, f: BinaryIO) -> None:
        self.f = f

    def bytes(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise _Truncated
        return data

    def scalar(self, fmt: str) -> Any:
        return struct.unpack("<" + fmt, self.bytes(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return self.bytes(self.scalar("Q")).decode("utf-8", errors="replace")

    def value(self, kind: int, defer: int | None = None) -> Any:
        """The value of type `kind` here; an array longer than `defer` is skipped and
        returned as a `Deferred` to read later."""
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            at = self.f.tell()
            inner, count = self.scalar("I"), self.scalar("Q")
            if defer is not None and count > defer and inner != ARRAY:
                if inner == STRING:
                    for _ in range(count):
                        self.f.seek(self.scalar("Q"), 1)
                else:
                    self.f.seek(count * struct.calcsize(_format(inner)), 1)
                return Deferred(at, count)
            if inner == STRING:
                return [self.string() for _ in range(count)]
            if inner == ARRAY:
                return [self.value(ARRAY) for _ in range(count)]
            fmt = _format(inner)
            values = np.frombuffer(self.bytes(count * struct.calcsize(fmt)), "<" + fmt)
            return values.tolist()
        return self.scalar(_format(kind))


@dataclass(frozen=True)
class Deferred:
    """A long array of the metadata (a tokenizer's vocabulary), read when it is asked for."""

    offset: int     # of its element type, in the file
    count: int


class Metadata(Mapping[str, Any]):
    """A GGUF file's metadata, key → value. Long arrays are read from the file each time they
    are asked for, not kept: the vocabulary's strings live only while a tokenizer is built."""

    def __init__(self, path: Path, values: dict[str, Any]) -> None:
        self.path, self._values = path, values

    def __getitem__(self, key: str) -> Any:
        value = self._values[key]
        if not isinstance(value, Deferred):
            return value
        with self.path.open("rb") as f:
            f.seek(value.offset)
            try:
                return _Cursor(f).value(ARRAY)
            except _Truncated:
                raise WeightsError(f"{self.path}: metadata {key!r} runs past the end of the "
                                   "file; is it truncated?") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def size(self, key: str) -> int:
        """The number of entries of an array (0 when absent), without reading them."""
        value = self._values.get(key)
        return value.count if isinstance(value, Deferred) else len(value or ())


def _format(kind: int) -> str:
    if kind not in SCALARS:
        raise ValueError(f"unknown metadata value type {kind}")
    return SCALARS[kind]


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the table: `shape` as GGUF lists it (innermost first), `tensor_type` a
    GGMLQuantizationType, `offset` and `n_bytes` of its stored bytes in the file."""

    path: Path
    name: str
    shape: tuple[int, ...]
    tensor_type: Any
    offset: int
    n_bytes: int

    @property
    def data(self) -> np.ndarray:
        """The stored values, mapped read-only for as long as the array (or a view) lives:
        [..., N, K] of its element type for float and integer types, [..., N, bytes per row]
        of uint8 for block types and BF16."""
        dims = tuple(reversed(self.shape))
        kind = self.tensor_type.name
        if kind in ELEMENTS:
            dtype, dims_stored = np.dtype(ELEMENTS[kind]), dims
        else:
            dtype = np.dtype(np.uint8)
            dims_stored = (*dims[:-1], self.n_bytes // max(1, int(np.prod(dims[:-1]))))
        if self.n_bytes == 0:
            return np.zeros(dims_stored, dtype)
        return np.memmap(self.path, dtype=dtype, mode="r", offset=self.offset,
                         shape=dims_stored)


def read_gguf(path: Path, block_sizes: dict[Any, tuple[int, int]], types: Any
              ) -> tuple[Metadata, dict[str, TensorInfo]]:
    """The metadata (key → value) and the tensor table (name → TensorInfo) of the GGUF file at
    `path`; `block_sizes` and `types` are the gguf package's GGML_QUANT_SIZES and
    GGMLQuantizationType. A file that is not GGUF, is cut short or names a tensor twice is
    refused, naming the file."""
    size = path.stat().st_size
    try:
        with path.open("rb") as f:
            c = _Cursor(f)
            if c.bytes(4) != MAGIC:
                raise ValueError("it does not start with GGUF")
            version = c.scalar("I")
            if version not in (2, 3):
                raise ValueError(f"GGUF version {version} (read: 2 and 3, little-endian)")
            tensor_count, field_count = c.scalar("Q"), c.scalar("Q")
            values = {}
            for _ in range(field_count):
                key = c.string()
                values[key] = c.value(c.scalar("I"), defer=DEFERRED)
            table = []
            for _ in range(tensor_count):
                name = c.string()
                dims = tuple(c.scalar("Q") for _ in range(c.scalar("I")))
                table.append((name, dims, c.scalar("I"), c.scalar("Q")))
            start = f.tell()
    except _Truncated:
        raise WeightsError(f"{path}: not a readable GGUF file (it ends inside its metadata); "
                           "is it truncated?") from None
    except (ValueError, OverflowError, MemoryError) as err:
        raise WeightsError(f"{path}: not a readable GGUF file ({err}); is it truncated or not "
                           "GGUF at all?") from None
    fields = Metadata(path, values)
    alignment = fields.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment < 1:
        raise WeightsError(f"{path}: general.alignment is {alignment!r}, not a whole number ≥ 1")
    start += -start % alignment
    tensors: dict[str, TensorInfo] = {}
    for name, dims, raw_type, offset in table:
        if name in tensors:
            raise WeightsError(f"{path}: tensor {name!r} is listed twice")
        try:
            kind = types(raw_type)
        except ValueError:
            raise WeightsError(f"{path}: tensor {name!r} has GGML type {raw_type}, which the "
                               "gguf package does not know") from None
        block, block_bytes = block_sizes[kind]
        elements = int(np.prod(dims, dtype=object)) if dims else 1
        info = TensorInfo(path, name, dims, kind, start + offset, elements // block * block_bytes)
        if info.offset + info.n_bytes > size:
            raise WeightsError(f"{path}: tensor {name!r} ends past the end of the file "
                               f"({size} bytes); is it truncated?")
        tensors[name] = info
    return fields, tensors
