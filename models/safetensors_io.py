"""Minimal safetensors reader/writer on numpy memory maps.

Why not `safetensors.numpy`: it has no bfloat16 and reads whole tensors. A memory map lets a sharded
load read only the rows a device needs (`TensorFile.read(name, slices)`), and `ml_dtypes` (a JAX
dependency) gives bfloat16. The format is: 8-byte little-endian header size, a JSON header
{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}, then the raw bytes.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in _DTYPES.items()}


class TensorFile:
    """Read-only view of one .safetensors file."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        self.metadata = header.pop("__metadata__", {}) or {}
        self._data_start = 8 + n
        self.entries = header

    def keys(self):
        return self.entries.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name]["shape"])

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        """The tensor (or `tensor[index]`), read through a memory map: only the touched pages load."""
        e = self.entries[name]
        try:
            dtype = _DTYPES[e["dtype"]]
        except KeyError:
            raise ValueError(f"{self.path}: tensor {name} has unsupported dtype {e['dtype']}") from None
        begin, end = e["data_offsets"]
        shape = tuple(e["shape"])
        if end - begin != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
            raise ValueError(f"{self.path}: tensor {name} byte range {end - begin} does not match shape {shape}")
        if end == begin:
            return np.zeros(shape, dtype)
        mm = np.memmap(self.path, dtype=dtype, mode="r", offset=self._data_start + begin, shape=shape)
        return np.array(mm if index is None else mm[index])


def write(path: str | os.PathLike, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None):
    """Write `tensors` to `path` atomically (temp file + rename)."""
    header, offset = {}, 0
    for name, arr in tensors.items():
        arr = np.asarray(arr)
        if arr.dtype not in _NAMES:
            raise ValueError(f"cannot write tensor {name} of dtype {arr.dtype}")
        header[name] = {"dtype": _NAMES[arr.dtype], "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    header["__metadata__"] = dict(metadata or {"format": "pt"})
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = Path(f"{path}.tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for arr in tensors.values():
            f.write(np.ascontiguousarray(arr).tobytes())
    os.replace(tmp, path)
