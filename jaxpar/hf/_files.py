"""Safetensors files: reading slices of named tensors, and writing files one tensor at a time.

:class:`CheckpointFiles` indexes a checkpoint directory (``model.safetensors``, or the files of
``model.safetensors.index.json``) by reading only the files' headers, and reads any box of any
tensor through ``safetensors``' ``get_slice`` (memory-mapped: only that box's bytes are read),
counting the bytes it returns. :func:`write_safetensors` writes a file from an iterator of
tensors, so at most one tensor is in host memory at a time (the ``safetensors`` library's own
writer takes a whole dict).

>>> import numpy as np, tempfile, pathlib
>>> d = pathlib.Path(tempfile.mkdtemp())
>>> write_safetensors(d / "model.safetensors", {"a": ((2, 3), "F32")}, iter([np.arange(6, dtype=np.float32)
...                                                                             .reshape(2, 3)]))
>>> files = CheckpointFiles(d)
>>> files.shape("a"), files.read("a", (slice(1, 2), slice(0, 3))).tolist(), files.bytes_read
((2, 3), [[3.0, 4.0, 5.0]], 12)
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Iterable, Iterator

import ml_dtypes
import numpy as np
from jaxpar.errors import HFFilesError

#: safetensors dtype names -> numpy dtypes.
DTYPES = {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16),
          "F64": np.dtype(np.float64)}
#: ``config.json`` dtype names -> safetensors dtype names.
SAFETENSORS_DTYPE = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64"}
INDEX = "model.safetensors.index.json"


def _header(path: Path) -> dict:
    with open(path, "rb") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(size))


class CheckpointFiles:
    """The tensors of a checkpoint directory, by name.

    Args:
      path: the directory.

    Raises:
      HFFilesError: no safetensors file, an index naming a missing file, or a key in two files.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        index = self.path / INDEX
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
        if not files:
            raise HFFilesError(f"{self.path}: no *.safetensors file (jaxpar reads safetensors checkpoints only).")
        self.where: dict[str, str] = {}
        self.info: dict[str, dict] = {}
        for name in files:
            if not (self.path / name).is_file():
                raise HFFilesError(f"{index}: names {name!r}, which is not in {self.path}.")
            for key, info in _header(self.path / name).items():
                if key == "__metadata__":
                    continue
                if key in self.where:
                    raise HFFilesError(f"{self.path}: tensor {key!r} is in both {self.where[key]} and {name}.")
                self.where[key], self.info[key] = name, info
        self.order = list(self.where)
        self.bytes_read = 0
        self._open: dict[str, object] = {}

    def shape(self, key: str) -> tuple[int, ...]:
        """The tensor's shape.

        Args:
          key: the tensor's name.

        Returns:
          Its shape.
        """
        return tuple(self.info[key]["shape"])

    def dtype(self, key: str) -> str:
        """The tensor's safetensors dtype name (``"BF16"``, ``"F32"``, ...).

        Args:
          key: the tensor's name.

        Returns:
          The dtype's name.
        """
        return self.info[key]["dtype"]

    def read(self, key: str, box: tuple[slice, ...]) -> np.ndarray:
        """The ``box`` (one slice per axis) of tensor ``key``, in its own dtype.

        Args:
          key: the tensor's name.
          box: one slice per axis, or ``()``: the whole tensor.

        Returns:
          The values.
        """
        from safetensors import safe_open

        name = self.where[key]
        if name not in self._open:
            self._open[name] = safe_open(str(self.path / name), framework="np")
        out = self._open[name].get_slice(key)[box] if box else self._open[name].get_tensor(key)
        out = np.asarray(out)
        self.bytes_read += out.nbytes
        return out


def _aligned_header(entries: dict[str, tuple[tuple[int, ...], str]]) -> tuple[bytes, list[int]]:
    header, offset, sizes = {"__metadata__": {"format": "pt"}}, 0, []
    for key, (shape, dtype) in entries.items():
        size = int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype].itemsize
        header[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset, sizes = offset + size, sizes + [size]
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return raw, sizes


def write_safetensors(path: str | Path, entries: dict[str, tuple[tuple[int, ...], str]],
                      tensors: Iterable[np.ndarray] | Iterator[np.ndarray]) -> None:
    """Write a safetensors file whose tensors come one at a time.

    Args:
      path: the file.
      entries: ``{key: (shape, safetensors dtype)}``, in file order.
      tensors: the arrays in the same order, each of its entry's shape and dtype.

    Raises:
      HFFilesError: an array whose shape or dtype differs from its entry (the file is removed).
    """
    raw, sizes = _aligned_header(entries)
    path = Path(path)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for (key, (shape, dtype)), array, size in zip(entries.items(), tensors, sizes, strict=True):
            array = np.ascontiguousarray(array)
            if tuple(array.shape) != tuple(shape) or array.dtype != DTYPES[dtype]:
                f.close()
                path.unlink()
                raise HFFilesError(f"{path}: tensor {key!r} is {array.dtype}{list(array.shape)}, the header says "
                                   f"{dtype}{list(shape)}.")
            f.write(array.reshape(-1).view(np.uint8).data)      # the array's own buffer: no copy
