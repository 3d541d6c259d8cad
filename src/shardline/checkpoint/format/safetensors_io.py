"""Write ``.safetensors`` files tensor by tensor, hashing while writing.

Note: the format (https://github.com/huggingface/safetensors): an 8-byte little-endian header
length N, N bytes of JSON ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, ...,
"__metadata__": {str: str}}`` (padded with spaces to a multiple of 8), then the tensors' raw
little-endian bytes, contiguous, in offset order. Offsets depend only on shapes and dtypes, so
the header is written first and each tensor is streamed in afterwards: the writer never holds
more than the tensor it is given. Files are read back by ``safetensors`` itself in the tests.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from shardline.errors import ConfigurationError

__all__ = ["SAFETENSORS_DTYPES", "SafetensorsWriter", "TensorSpec"]

SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


class TensorSpec:
    """Name, shape and dtype of one tensor to write (its bytes come later)."""

    __slots__ = ("dtype", "name", "shape")

    def __init__(self, name: str, shape: Sequence[int], dtype: torch.dtype) -> None:
        if dtype not in SAFETENSORS_DTYPES:
            raise ConfigurationError(f"tensor {name!r} has dtype {dtype}, which safetensors export does not support")
        self.name, self.shape, self.dtype = name, tuple(int(s) for s in shape), dtype

    @property
    def nbytes(self) -> int:
        return int(torch.Size(self.shape).numel()) * torch.empty((), dtype=self.dtype).element_size()


class SafetensorsWriter:
    """Writes one ``.safetensors`` file: header at construction, then :meth:`write` each tensor in order."""

    def __init__(self, path: Path, specs: Sequence[TensorSpec], metadata: Mapping[str, str] | None = None) -> None:
        self.path = path
        self._specs = list(specs)
        self._next = 0
        self._hash = hashlib.sha256()
        self.bytes = 0
        header: dict[str, object] = {}
        offset = 0
        for spec in self._specs:
            header[spec.name] = {
                "dtype": SAFETENSORS_DTYPES[spec.dtype],
                "shape": list(spec.shape),
                "data_offsets": [offset, offset + spec.nbytes],
            }
            offset += spec.nbytes
        if metadata:
            header["__metadata__"] = dict(metadata)
        text = json.dumps(header, separators=(",", ":")).encode("utf-8")
        text += b" " * (-len(text) % 8)
        self._file = open(path, "wb")  # noqa: SIM115 -- closed in close(); the writer spans many calls
        self._emit(struct.pack("<Q", len(text)) + text)

    def _emit(self, data: bytes | memoryview) -> None:
        self._file.write(data)
        self._hash.update(data)
        self.bytes += len(data)

    def write(self, tensor: torch.Tensor) -> None:
        """Write the next tensor's bytes (it must match the next spec's shape and dtype)."""
        spec = self._specs[self._next]
        if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
            raise ConfigurationError(
                f"{spec.name}: got {tuple(tensor.shape)} {tensor.dtype}, header says {spec.shape} {spec.dtype}"
            )
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        if sys.byteorder != "little" and tensor.element_size() > 1:
            raise ConfigurationError("safetensors export needs a little-endian machine")
        # numpy's stubs give ndarray the buffer protocol only for Python >= 3.12 (it has it on every version).
        self._emit(memoryview(data.numpy()))  # type: ignore[arg-type]
        self._next += 1

    def close(self) -> str:
        """Finish the file (every tensor must have been written), fsync it, and return its SHA-256."""
        if self._next != len(self._specs):
            self._file.close()
            raise ConfigurationError(f"{self.path}: {len(self._specs) - self._next} tensor(s) were never written")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        return self._hash.hexdigest()
