"""Safetensors read and write one tensor at a time, so conversion memory is one tensor, not one shard.

The reader parses the header itself and reads a tensor's bytes straight into a destination buffer (for
example one expert's slice of a stacked weight): no memory map, so resident memory stays what the
converter holds, and a truncated or corrupt file is reported with its name and tensor before any byte of
output is written. The writer lays the header out first from known shapes and then streams tensors in.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024  # the safetensors format's own limit


class ConversionError(ValueError):
    """Bad input for the converter; the message names the file and tensor."""


@dataclass(frozen=True)
class TensorInfo:
    """Where a tensor lives on disk and what it is."""

    name: str
    path: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data in the file
    nbytes: int


def _bytes_of(dtype: torch.dtype, shape: Iterable[int]) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def read_header(path: str) -> dict[str, TensorInfo]:
    """The tensors of one safetensors file, validated against the file's real size."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ConversionError(f"{path}: not a safetensors file (only {size} bytes)")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > min(_MAX_HEADER, size - 8):
            raise ConversionError(f"{path}: corrupt or truncated safetensors header (declares {header_len} "
                                  f"header bytes, the file has {size})")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConversionError(f"{path}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise ConversionError(f"{path}: corrupt safetensors header (not a JSON object)")
    data_start, data_size = 8 + header_len, size - 8 - header_len
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = DTYPES[entry["dtype"]]
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise ConversionError(f"{path}: tensor {name!r} has a corrupt header entry ({e!r})") from None
        if end - begin != _bytes_of(dtype, shape) or begin < 0:
            raise ConversionError(f"{path}: tensor {name!r} is corrupt: shape {list(shape)} {entry['dtype']} "
                                  f"needs {_bytes_of(dtype, shape)} bytes, the header gives {end - begin}")
        if end > data_size:
            raise ConversionError(f"{path}: truncated: tensor {name!r} ends at byte {data_start + end}, "
                                  f"the file has {size}")
        tensors[name] = TensorInfo(name, path, dtype, shape, data_start + begin, end - begin)
    return tensors


def _as_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


class Reader:
    """Reads tensors, or runs of their elements, into caller buffers; keeps each file open once."""

    def __init__(self):
        self._files: dict[str, object] = {}

    def read_into(self, info: TensorInfo, out: torch.Tensor, offset: int = 0) -> None:
        """Fill the contiguous CPU tensor ``out`` with ``out.numel()`` elements of the tensor, starting at
        element ``offset``."""
        assert out.is_contiguous() and out.dtype == info.dtype
        itemsize = out.element_size()
        nbytes = out.numel() * itemsize
        assert (offset + out.numel()) * itemsize <= info.nbytes
        f = self._files.get(info.path)
        if f is None:
            f = self._files[info.path] = open(info.path, "rb")
        f.seek(info.offset + offset * itemsize)
        got = f.readinto(_as_bytes(out)) if nbytes else 0
        if got != nbytes:
            raise ConversionError(f"{info.path}: truncated while reading tensor {info.name!r}")

    def read(self, info: TensorInfo) -> torch.Tensor:
        out = torch.empty(info.shape, dtype=info.dtype)
        self.read_into(info, out)
        return out

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self) -> "Reader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass(frozen=True)
class TensorSpec:
    """A tensor to be written: enough to lay out the header before any data exists."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return _bytes_of(self.dtype, self.shape)


def write_file(path: str, specs: list[TensorSpec], tensors: Iterator[torch.Tensor],
               metadata: dict[str, str] | None = None, on_written: Callable[[TensorSpec], None] | None = None) -> None:
    """Write ``specs`` to ``path``, pulling each tensor from ``tensors`` in order as it is written."""
    header: dict = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for spec in specs:
        header[spec.name] = {"dtype": DTYPE_NAMES[spec.dtype], "shape": list(spec.shape),
                             "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as the format recommends
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for spec in specs:
            t = next(tensors)
            if t.dtype != spec.dtype or tuple(t.shape) != spec.shape:
                raise AssertionError(f"{spec.name}: produced {t.dtype} {list(t.shape)}, planned "
                                     f"{spec.dtype} {list(spec.shape)}")
            if spec.nbytes:
                f.write(_as_bytes(t.contiguous()))
            del t
            if on_written is not None:
                on_written(spec)
