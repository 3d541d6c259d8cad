"""A tensor stored by ``torch.save``, decoded as a view of the bytes already in memory (no copy).

Note: why this exists. DCP's file-system writer stores every tensor item as its own
``torch.save`` archive (an uncompressed zip: ``data.pkl``, ``byteorder``, ``data/<key>``...).
``torch.load`` of such an item parses the zip through Python callbacks, runs the weights-only
unpickler and copies the record into a fresh storage; the reader then copies that storage once
more into the shard. For a 2 MiB item on the development machine, that is 0.70 ms against
0.23 ms for this decoder and its one copy. A verified load already holds each item's
bytes in memory to hash them, so it reads the tensor straight out of them instead: the zip
directory (``zipfile``), the pickle (an unpickler that knows only the few globals a plain tensor
pickle names, ``_torch_compat.tensor_pickle_global``) and a ``torch.frombuffer`` view that the
caller copies into its target. That leaves one copy per item, and a verified load costs what
plain DCP's does plus the hash (figures in docs/benchmarks.md).

Anything else -- a tensor subclass, a quantized or sparse tensor, another byte order, a
compressed record, a pickle naming any other global -- returns ``None`` and the caller uses
``torch.load(weights_only=True)`` as before, so this is never less safe than that: the
unpickler can build nothing but the records below, and the view is bounds-checked by torch
against the record it points into.
"""

from __future__ import annotations

import io
import pickle
import struct
import sys
import warnings
import zipfile
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from shardline import _torch_compat

__all__ = ["decode_tensor", "stored_record"]

_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, (version..sizes), name length, extra length
_LOCAL_SIGNATURE = b"PK\x03\x04"


@dataclass(frozen=True)
class _StorageRef:
    key: str
    dtype: torch.dtype | None  # None: an untyped storage (the dtype comes with the rebuild call)
    numel: int


@dataclass(frozen=True)
class _Rebuild:
    storage: _StorageRef
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


class _NotPlain(Exception):
    """The archive is not a plain dense CPU tensor: decode it with ``torch.load``."""


def _rebuild_v2(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any, *rest: Any) -> Any:
    if not isinstance(storage, _StorageRef) or storage.dtype is None or hooks or rest:
        raise _NotPlain
    return _Rebuild(storage, offset, tuple(size), tuple(stride), storage.dtype)


def _rebuild_v3(
    storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any, dtype: Any, *rest: Any
) -> Any:
    if not isinstance(storage, _StorageRef) or not isinstance(dtype, torch.dtype) or hooks or rest:
        raise _NotPlain
    return _Rebuild(storage, offset, tuple(size), tuple(stride), dtype)


class _StorageType:
    def __init__(self, dtype: torch.dtype | None) -> None:
        self.dtype = dtype


class _TensorUnpickler(pickle.Unpickler):
    """Builds only :class:`_Rebuild` records; any other global or persistent id is :class:`_NotPlain`."""

    def find_class(self, module: str, name: str) -> Any:
        role = _torch_compat.tensor_pickle_global(module, name)
        if role == "rebuild_v2":
            return _rebuild_v2
        if role == "rebuild_v3":
            return _rebuild_v3
        if role == "ordered_dict":
            return OrderedDict
        if role == "untyped_storage":
            return _StorageType(None)
        if role == "dtype":
            return getattr(torch, name)
        if role == "typed_storage":
            return _StorageType(_torch_compat.typed_storage_dtype(name))
        raise _NotPlain

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and pid[3] == "cpu"):
            raise _NotPlain
        _, kind, key, _, numel = pid
        if not isinstance(kind, _StorageType) or not isinstance(key, str) or not isinstance(numel, int):
            raise _NotPlain
        return _StorageRef(key, kind.dtype, numel)


class _BufferFile(io.RawIOBase):
    """A read-only, seekable file over a buffer that never copies it (``io.BytesIO`` copies all but ``bytes``)."""

    def __init__(self, data: bytes | memoryview) -> None:
        super().__init__()
        self._view = memoryview(data).cast("B")
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        chunk = self._view[self._pos : self._pos + len(buffer)]
        memoryview(buffer).cast("B")[: len(chunk)] = chunk
        self._pos += len(chunk)
        return len(chunk)


def _record_start(data: bytes | memoryview, info: zipfile.ZipInfo) -> int:
    """Where a stored (uncompressed) record's bytes begin, from its local header."""
    at = info.header_offset
    fields: tuple[bytes, int, int] = _LOCAL_HEADER.unpack_from(data, at)
    signature, name_len, extra_len = fields
    if signature != _LOCAL_SIGNATURE or info.compress_type != zipfile.ZIP_STORED:
        raise _NotPlain
    return at + _LOCAL_HEADER.size + name_len + extra_len


def stored_record(data: bytes | memoryview, info: zipfile.ZipInfo) -> memoryview:
    """The bytes of one stored (uncompressed) record of the archive ``data``, as a view, found through its local
    header and not checked against the CRC-32 in it.

    Note: shardline's writer saves its records without the CRC-32 (``_torch_compat.skip_save_crc32_here``
    says why): ``zipfile``'s own read would call every such record damaged. What stands for the CRC is
    the file's SHA-256, checked before any of these bytes is used.

    Raises:
        zipfile.BadZipFile: the record is compressed, its local header is not one, or it runs past ``data``.
    """
    try:
        start = _record_start(data, info)
    except (_NotPlain, struct.error):
        raise zipfile.BadZipFile(f"the record {info.filename!r} is not a stored record this reader can find") from None
    end = start + info.file_size
    if end > len(data):
        raise zipfile.BadZipFile(f"the record {info.filename!r} ends at byte {end} of an archive of {len(data)} bytes")
    return memoryview(data)[start:end]


def decode_tensor(data: bytes | memoryview) -> torch.Tensor | None:
    """The tensor ``torch.save`` wrote into ``data``, as a read-only view of ``data`` (no copy).

    ``data`` may be any buffer (``bytes``, or a ``memoryview`` of a mapped file).

    Returns ``None`` when ``data`` is not a plain dense tensor archive in this machine's byte
    order (use ``torch.load`` then). Raises when the archive is damaged in a way ``torch.load``
    would also refuse (e.g. a record shorter than its tensor); the caller reports it.
    """
    try:
        # bytes are shared by BytesIO; any other buffer (a mapped file) is read through a view, never copied
        archive = zipfile.ZipFile(io.BytesIO(data) if isinstance(data, bytes) else io.BufferedReader(_BufferFile(data)))
        names = archive.namelist()
        pickles = [n for n in names if n.endswith("/data.pkl")]
        if len(pickles) != 1:
            return None
        prefix = pickles[0][: -len("data.pkl")]
        if f"{prefix}byteorder" not in names:
            return None
        if bytes(stored_record(data, archive.getinfo(f"{prefix}byteorder"))).decode() != sys.byteorder:
            return None
        rebuilt = _TensorUnpickler(io.BytesIO(stored_record(data, archive.getinfo(pickles[0])))).load()
        if not isinstance(rebuilt, _Rebuild):
            return None
        storage = rebuilt.storage
        info = archive.getinfo(f"{prefix}data/{storage.key}")
        start = _record_start(data, info)
    except Exception:  # anything unparsable is torch.load's to decode or to refuse
        # Note: a damaged pickle fails in many ways here (UnpicklingError, EOFError, TypeError from a
        # rebuild called with the wrong arguments, UnicodeDecodeError...). Declining all of them hands
        # the bytes to torch.load, whose error the reader reports beside the hash check; a decoder bug
        # that declined everything would show in test_tensor_record's real-checkpoint test.
        return None
    itemsize = rebuilt.dtype.itemsize
    count = info.file_size // itemsize
    promised = storage.numel * itemsize if storage.dtype is not None else storage.numel  # untyped: bytes
    if info.file_size != promised:
        raise ValueError(f"a tensor record holds {info.file_size} bytes where its pickle promises {promised}")
    if start + info.file_size > len(data):
        raise ValueError(f"a tensor record ends at byte {start + info.file_size} of an item of {len(data)} bytes")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "the given buffer is not writable": only read from
        flat = (
            torch.frombuffer(data, dtype=rebuilt.dtype, count=count, offset=start)
            if count
            else torch.empty(0, dtype=rebuilt.dtype)
        )
    return flat.as_strided(rebuilt.size, rebuilt.stride, rebuilt.offset)
