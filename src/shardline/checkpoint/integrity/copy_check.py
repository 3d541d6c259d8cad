"""An async save writes exactly the bytes it staged: the staged copy is hashed, the written file is checked against it.

Note: why. An async save copies the state ("stages" it) so that training can go on while a
background thread writes. If the copy is not really a copy -- a staging step that skips tensors
already on the CPU, a pinned buffer reused while a write still reads it, a copy still in flight --
training's next update lands
in the checkpoint: the files then mix two steps, and their hashes (computed while writing)
faithfully describe the wrong bytes. torch's own async save had exactly this bug for CPU tensors
(pytorch/pytorch#144657). The manifest cannot catch it; only a record of the bytes *at staging
time* can.

How:

1. :class:`StagedDigester` (on the training thread, before ``save`` returns) hashes every
   staged tensor's bytes on the two SHA-256 helper threads, each tensor as soon as its copy is
   made, keyed by where the tensor lives (device, data pointer). The staged copies are host
   buffers (:mod:`.host_buffers`), so the hash reads the very bytes DCP writes: no second copy
   off the device.
2. After DCP has written this rank's file, :func:`check_written` (on the background thread)
   reads back each tensor item from the file -- DCP writes each one as a ``torch.save`` archive at
   an offset it reports -- takes the one storage record inside it, and compares its SHA-256 with
   the staged digest of the tensor DCP resolved for that item. A difference fails the save on
   every rank (nothing is committed) naming the tensor; so does a tensor the staging never saw.

Non-tensor items (trainer state, the config) are immutable Python bytes/strings built during
staging; they are not checked here. The cost is one SHA-256 pass over the rank's state while
the training thread copies it (on two helper threads) and one read-back and hash on the background thread
(docs/benchmarks.md has the figures).
"""

from __future__ import annotations

import hashlib
import io
import re
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import DTensor

from shardline.checkpoint.format.tensor_record import stored_record
from shardline.checkpoint.integrity.hashing import hasher_pool
from shardline.checkpoint.storage.protocol import Location

__all__ = ["StagedDigester", "StagedTensor", "check_written", "digest_staged", "tensor_key"]

_DATA_RECORD = re.compile(r"(?:^|/)data/\d+$")


@dataclass(frozen=True)
class StagedTensor:
    """One staged tensor: where it sits in the state dict, its size, and the SHA-256 of its bytes."""

    name: str
    nbytes: int
    sha256: str


def tensor_key(tensor: torch.Tensor) -> tuple[str, int]:
    """Where a tensor's data lives: ``(device, data pointer)`` (views DCP resolves share it)."""
    return str(tensor.device), int(tensor.data_ptr())


def _payload(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes ``torch.save`` writes for ``tensor`` as DCP hands it over, as a flat uint8 CPU tensor.

    DCP clones a tensor that does not span its whole storage before saving it; ``torch.save``
    then writes the (compact) storage.
    """
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    storage = t.untyped_storage()
    if storage.nbytes() != t.numel() * t.element_size():
        t = t.clone()
        storage = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def _sha256(tensor: torch.Tensor) -> str:
    # numpy's stubs give ndarray the buffer protocol only for Python >= 3.12 (it has it on every version).
    return hashlib.sha256(_payload(tensor).numpy()).hexdigest()  # type: ignore[arg-type]


def _tensors(obj: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(obj, DTensor):
        yield prefix, obj.to_local()
    elif isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from _tensors(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _tensors(value, f"{prefix}.{i}")


class StagedDigester:
    """Hashes staged tensors as they are copied, so the digests overlap the staging copy.

    Note: staging copies tensor after tensor on the training thread; each copy is handed to
    :meth:`add` and hashed on the SHA-256 helper threads while the next one is copied, so the
    training loop waits about max(copy, hash) rather than their sum. :meth:`digests` then hashes
    whatever the staging did not hand over (a ``full`` save's gathered tensors, or a staging step
    that skipped a tensor) and waits for every digest.
    """

    def __init__(self) -> None:
        self._pool = hasher_pool()
        self._futures: dict[tuple[Any, ...], Any] = {}

    def add(self, tensor: torch.Tensor) -> None:
        """Start hashing one staged tensor (a no-op for an empty one, or one already started)."""
        key = self._identity(tensor)
        if tensor.numel() and key not in self._futures:
            self._futures[key] = self._pool.submit(_sha256, tensor)

    @staticmethod
    def _identity(tensor: torch.Tensor) -> tuple[Any, ...]:
        # the same bytes: where they start, and the view's shape, strides and dtype
        return (*tensor_key(tensor), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)

    def digests(self, state_dict: Mapping[str, Any]) -> dict[tuple[str, int], StagedTensor]:
        """Every tensor of the staged ``state_dict`` (local shards of DTensors), keyed by :func:`tensor_key`."""
        named = [(name, t) for name, t in _tensors(state_dict, "") if t.numel()]
        for _, tensor in named:
            self.add(tensor)
        return {
            tensor_key(t): StagedTensor(
                name=name, nbytes=t.numel() * t.element_size(), sha256=self._futures[self._identity(t)].result()
            )
            for name, t in named
        }


def digest_staged(state_dict: Mapping[str, Any]) -> dict[tuple[str, int], StagedTensor]:
    """Hash every tensor of a staged state dict (local shards of DTensors), keyed by :func:`tensor_key`.

    Runs on the calling thread until every digest is known, the hashing spread over the two
    SHA-256 helper threads. Empty tensors are left out (they write no bytes).
    """
    return StagedDigester().digests(state_dict)


def _written_record(file: Location, offset: int, length: int, handles: dict[str, Any]) -> memoryview:
    """The storage record (the tensor's bytes) of the ``torch.save`` archive at ``file[offset:offset + length]``.

    ``handles`` keeps each file open across its items (in an object store an open is a request)."""
    f = handles.get(str(file))
    if f is None:
        f = handles[str(file)] = file.open("rb")
    f.seek(offset)
    data = f.read(length)
    if len(data) != length:
        raise OSError(f"{file.name} is {offset + len(data)} bytes, shorter than the item at {offset}+{length}")
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        records = [info for info in archive.infolist() if _DATA_RECORD.search(info.filename)]
        if len(records) != 1:
            raise OSError(f"the item at {file.name}:{offset} holds {len(records)} storage records, expected 1")
        return stored_record(data, records[0])  # its CRC-32 is not checked: the writer saves none


def _written_digest(file: Location, offset: int, length: int, handles: dict[str, Any]) -> str:
    """SHA-256 of the storage record of the ``torch.save`` archive at ``file[offset:offset + length]``."""
    return hashlib.sha256(_written_record(file, offset, length, handles)).hexdigest()


def check_written(
    root: Location,
    plan: SavePlan,
    planner: SavePlanner,
    results: list[WriteResult],
    staged: Mapping[tuple[str, int], StagedTensor],
) -> list[str]:
    """Problems where a tensor item of ``results`` (this rank's writes under ``root``) differs from its staged bytes.

    An item whose tensor the staging did not hash is a problem too (the write would have taken
    bytes from somewhere else than the staged copy).
    """
    items = {item.index: item for item in plan.items if item.type != WriteItemType.BYTE_IO}
    problems: list[str] = []
    handles: dict[str, Any] = {}
    try:
        _check_results(root, items, planner, results, staged, problems, handles)
    finally:
        for f in handles.values():
            f.close()
    return problems


def _check_results(
    root: Location,
    items: Mapping[Any, Any],
    planner: SavePlanner,
    results: list[WriteResult],
    staged: Mapping[tuple[str, int], StagedTensor],
    problems: list[str],
    handles: dict[str, Any],
) -> None:
    for result in results:
        item = items.get(result.index)
        info = result.storage_data
        if item is None or not hasattr(info, "relative_path"):
            continue
        parts = _segment_parts(planner, result.index.fqn)
        if parts is not None:
            _check_segment(root, result.index.fqn, info, parts, staged, problems, handles)
            continue
        tensor = planner.resolve_data(item)
        if not isinstance(tensor, torch.Tensor) or tensor.numel() == 0:
            continue
        expected = staged.get(tensor_key(tensor))
        if expected is None:
            problems.append(f"{result.index.fqn}: the tensor written is not one the staging copied and hashed")
            continue
        try:
            actual = _written_digest(root / info.relative_path, int(info.offset), int(info.length), handles)
        except (OSError, zipfile.BadZipFile) as e:
            problems.append(f"{result.index.fqn}: its bytes cannot be read back from {info.relative_path} ({e})")
            continue
        if actual != expected.sha256:
            problems.append(
                f"{expected.name}: the bytes written to {info.relative_path} (sha256 {actual[:16]}...) are not the "
                f"bytes staged (sha256 {expected.sha256[:16]}...)"
            )


def _segment_parts(planner: SavePlanner, key: str) -> list[tuple[int, torch.Tensor]] | None:
    """The staged pieces of a packed segment (``(element offset, flat tensor)``), or None for any other item."""
    packed = getattr(planner, "packed", None)
    if packed is None or key not in packed.segments:
        return None
    parts: list[tuple[int, torch.Tensor]] = packed.parts(key)
    return parts


def _check_segment(
    root: Location,
    key: str,
    info: Any,
    parts: list[tuple[int, torch.Tensor]],
    staged: Mapping[tuple[str, int], StagedTensor],
    problems: list[str],
    handles: dict[str, Any],
) -> None:
    """A packed segment is checked piece by piece: each piece's bytes in the file against its staged digest.

    Note: the segment itself is assembled at write time (``PackedSave.segment_data``), so no digest of it
    exists from staging; its pieces are the staged tensors, and their digests are what the file must match.
    """
    try:
        record = _written_record(root / info.relative_path, int(info.offset), int(info.length), handles)
    except (OSError, zipfile.BadZipFile) as e:
        problems.append(f"{key}: its bytes cannot be read back from {info.relative_path} ({e})")
        return
    view = memoryview(record)
    for offset, flat in parts:
        if not flat.numel():
            continue
        expected = staged.get(tensor_key(flat))
        if expected is None:
            problems.append(f"{key}: a piece written is not one the staging copied and hashed")
            continue
        start = offset * flat.element_size()
        actual = hashlib.sha256(view[start : start + expected.nbytes]).hexdigest()
        if actual != expected.sha256:
            problems.append(
                f"{expected.name}: the bytes written to {info.relative_path} (segment {key}, sha256 {actual[:16]}...) "
                f"are not the bytes staged (sha256 {expected.sha256[:16]}...)"
            )
