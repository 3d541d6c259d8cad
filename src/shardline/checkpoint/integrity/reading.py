"""A DCP ``StorageReader`` that verifies the checkpoint's data files in the pass that reads them.

Note: how a verified load reads every byte once and hashes it once.

* The coordinator's ``prepare_global_plan`` sees every rank's read plan. It gives each data
  file to exactly one rank to hash -- the rank that reads the most of it (at the same world
  size and layout, rank r hashes the file rank r wrote, which it reads whole anyway), ties
  going to the rank with the least to hash -- so the ranks hash disjoint shares covering every
  file, including files no rank reads anything from (a rank that wrote several files hashes all of them,
  each on its own thread). The assignment -- the manifest entries (name, size, SHA-256) of the
  rank's share -- rides to each rank in its ``LoadPlan.storage_data``; DCP scatters the plans
  already, so this costs no collective, and a rank other than the coordinator needs no other
  entry of the manifest (it receives its share, not the whole file list: 17 MB at 16,384 ranks).
* ``read_data`` reads a file it must hash from start to end in one sequential pass: each item's
  bytes are read once into memory, fed to SHA-256 (on a helper thread, overlapping the
  deserialization of the same bytes and the read of the next item) and deserialized from that
  memory; the gaps between items are read and hashed too. Files it need not hash are read item
  by item.
* A rank whose file differs from the manifest (or is short) raises ``IntegrityError`` at the end
  of ``read_data``. DCP runs ``read_data`` inside an all-gather and re-raises any rank's error on
  every rank, so that all-gather is the one agreement: either every rank learns that every
  file verified, or every rank raises. Like plain DCP, ``load`` reads the model's shards in
  place; buffers, 0-d parameters, the optimizer state and the trainer state are installed, and
  ``load`` returns, only after that agreement (see the note in ``load.py``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import errno
import hashlib
import heapq
import io
import mmap
import os
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from shardline.checkpoint.coordination.parallelism import cores_per_rank
from shardline.checkpoint.format.dcp_io import MetadataReader
from shardline.checkpoint.format.tensor_record import decode_tensor
from shardline.checkpoint.integrity.hashing import hasher_pool
from shardline.checkpoint.integrity.manifest import read_error, read_manifest
from shardline.checkpoint.integrity.verify import FileProblem
from shardline.checkpoint.storage.protocol import Location
from shardline.checkpoint.storage.stores import locate, store_for
from shardline.errors import CheckpointError, CheckpointReadError, IntegrityError

__all__ = ["ASSIGNMENT_KEY", "VerifyingReader", "assign_hashing"]

ASSIGNMENT_KEY = "shardline_hash_files"
READS_KEY = "shardline_reads"
"""A local load plan's ``storage_data`` key: the bytes the rank reads per file, totalled by the rank itself."""
_CHUNK = 8 << 20
_OVERLAP_MIN = 1 << 20


def assign_hashing(files: Mapping[str, int], reads: Sequence[Mapping[str, int]]) -> list[list[str]]:
    """Which files each rank hashes: each file to one rank, the one reading most of it, then the least loaded.

    Args:
        files: ``name -> size`` of every file to hash.
        reads: Per rank, ``name -> bytes`` that rank reads from that file.
    """
    # Note: linear in the files and the reads, not files x ranks (the coordinator of 16,384 ranks assigns 131k
    # files): a file's candidates are the ranks that read it; a file no rank reads goes to the least loaded rank,
    # kept at the top of a heap of (bytes, files, rank) whose stale entries are skipped. The file count breaks
    # ties so that files of no bytes (ranks that hold no rows of any tensor write empty files) spread over the
    # ranks instead of all going to the first one: each costs an open and a record in that rank's load plan.
    load = [0] * len(reads)
    count = [0] * len(reads)
    out: list[list[str]] = [[] for _ in reads]
    readers: dict[str, list[int]] = {}
    for r, per_file in enumerate(reads):
        for name, nbytes in per_file.items():
            if nbytes > 0:
                readers.setdefault(name, []).append(r)
    least = [(0, 0, r) for r in range(len(reads))]
    for name, size in sorted(files.items(), key=lambda item: (-item[1], item[0])):
        candidates = readers.get(name)
        if candidates:
            best = max(candidates, key=lambda r: (reads[r][name], -load[r], -count[r], -r))
        else:
            while (least[0][0], least[0][1]) != (load[least[0][2]], count[least[0][2]]):
                heapq.heappop(least)
            best = least[0][2]
        out[best].append(name)
        load[best] += size
        count[best] += 1
        heapq.heappush(least, (load[best], count[best], best))
    return out


def _entry(listed: Mapping[str, Any]) -> dict[str, Any]:
    """What a rank checks a file against: its name, size and SHA-256 as the manifest lists them."""
    return {"path": str(listed["path"]), "bytes": int(listed["bytes"]), "sha256": str(listed["sha256"])}


def _settle(pending: concurrent.futures.Future[None] | None) -> None:
    """Wait for a digest update running on a helper thread (``None``: nothing pending)."""
    if pending is not None:
        pending.result()


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else ""


def _narrow(tensor: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    for dim, (offset, length) in enumerate(zip(offsets, lengths, strict=True)):
        if offset != 0 or length != tensor.size(dim):
            tensor = tensor.narrow(dim, offset, length)
    return tensor


class VerifyingReader(MetadataReader):
    """DCP reader over checked metadata that hashes its share of ``to_hash`` while reading.

    Args:
        path: The checkpoint directory.
        metadata: Its DCP metadata, already checked against the manifest.
        to_hash: The manifest entries (``{path, bytes, sha256}``) of the data files to verify, on
            DCP's coordinator (it assigns them to the ranks); empty to read without hashing (level
            ``sizes``/``none``), or on another rank that learns its share in its plan.
        verify: Whether the data files are hashed (default: whether ``to_hash`` lists any); ``True``
            on a rank other than the coordinator of a verified load, which then fails closed when
            its plan carries no share.
    """

    def __init__(
        self,
        path: Location | str | os.PathLike[str],
        metadata: Metadata,
        *,
        to_hash: Sequence[Mapping[str, Any]],
        verify: bool | None = None,
    ) -> None:
        super().__init__(str(path), metadata)
        # On an object store, one listing gives every file's size (no HEAD request per file; objects.py).
        location = locate(path)
        self._store = store_for(location)
        self._root = self._store.snapshot(location)
        # DCP's reader keeps a Path; an object-store URL must not become one. DCP types the attribute as
        # os.PathLike, which a location in an object store is not (only this reader's own methods use it).
        self.path = self._root  # type: ignore[assignment]
        self._to_hash = {str(e["path"]): e for e in to_hash}
        self._verify = bool(to_hash) if verify is None else verify
        self._mine: dict[str, Mapping[str, Any]] = {}  # this rank's share, from its plan (read_data)
        self.hashed: dict[str, str] = {}
        # The planner fills nested containers of the state dict; files read on several threads take turns in it.
        self._planner_lock = threading.Lock()

    # ------------------------------------------------------------------ planning (coordinator)
    def _reads_per_file(self, items: Sequence[ReadItem]) -> dict[str, int]:
        per_file: dict[str, int] = {}
        for item in items:
            info = self.storage_data[item.storage_index]
            per_file[info.relative_path] = per_file.get(info.relative_path, 0) + int(info.length)
        return per_file

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        plan = super().prepare_local_plan(plan)
        if not self._verify:
            return plan
        # Note: each rank totals its reads per file here, in parallel, so the coordinator sums W small dicts
        # instead of walking every rank's read items (in the per-tensor layout, a chunk per rank and tensor:
        # 35M items at 16,384 ranks of a 70B model, about a minute of rank 0's CPU).
        return dataclasses.replace(plan, storage_data={READS_KEY: self._reads_per_file(plan.items)})

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        plans = super().prepare_global_plan(plans)
        if not self._verify:
            return plans
        reads: list[dict[str, int]] = []
        for plan in plans:
            totals = plan.storage_data.get(READS_KEY) if isinstance(plan.storage_data, dict) else None
            # a plan that lost its totals on the way (a torch version that rebuilds plans) is totalled here
            reads.append(dict(totals) if isinstance(totals, dict) else self._reads_per_file(plan.items))
        shares = assign_hashing({name: int(e["bytes"]) for name, e in self._to_hash.items()}, reads)
        return [
            dataclasses.replace(plan, storage_data={ASSIGNMENT_KEY: [_entry(self._to_hash[n]) for n in share]})
            for plan, share in zip(plans, shares, strict=True)
        ]

    # ------------------------------------------------------------------ reading (every rank)
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        assignment = plan.storage_data.get(ASSIGNMENT_KEY) if isinstance(plan.storage_data, dict) else None
        if self._verify and assignment is None:
            # Note: fail closed. Every rank's plan carries its share (possibly empty); a plan without one
            # means the coordinator's assignment was lost on the way, and nothing would be verified.
            raise CheckpointError(
                f"reading checkpoint {self.path}: this rank's load plan carries no hashing assignment, so its "
                "files would go unverified; this torch version may rebuild load plans (see checkpoint/reading.py)"
            )
        self._mine = {str(e["path"]): e for e in assignment or ()}
        mine = set(self._mine)
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        problems: list[FileProblem] = []

        def read_file(name: str) -> None:
            try:
                if name in mine:
                    self._read_hashing(name, per_file.get(name, []), planner, problems)
                else:
                    self._read_items(name, per_file[name], planner)
            except FileNotFoundError:
                problems.append(FileProblem(name, "missing", "listed in the checkpoint but not present"))
            except OSError as e:  # EIO, ESTALE, EACCES: the file system failed; that shows nothing about the bytes
                raise read_error(self._root / name, e) from e

        names = sorted(set(per_file) | mine)
        threads = min(len(names), cores_per_rank())
        if threads > 1:
            # Note: one thread per file (a rank written as several files is verified on several cores at
            # once). Every file is waited for before the first error is raised, so nothing reads on after it.
            with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="shardline-read") as pool:
                futures = [pool.submit(read_file, name) for name in names]
            for done in futures:
                done.result()
        else:
            for name in names:
                read_file(name)
        problems.sort(key=lambda p: (p.path, p.kind))
        damage = [p for p in problems if p.kind != "unreadable"]
        if damage:
            listing = "; ".join(f"{p.path}: {p.kind} ({p.detail})" for p in damage)
            raise IntegrityError(
                f"checkpoint {self.path} does not match its manifest -- {listing}; it was not loaded. Run "
                f"`shardline verify {self.path}` for a full report."
            )
        if problems:
            raise self._undecodable("; ".join(f"{p.path}: {p.detail}" for p in problems))
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _open(self, name: str) -> BinaryIO:
        """``name`` opened for unbuffered reading (a local file) or ranged streaming reads (an object)."""
        return self._store.open_read(self._root / name)

    def _groups(self, items: list[ReadItem]) -> list[tuple[int, int, list[ReadItem]]]:
        """Items by byte range, in file order (DCP never writes overlapping ranges)."""
        ranges: dict[tuple[int, int], list[ReadItem]] = {}
        for item in items:
            info = self.storage_data[item.storage_index]
            ranges.setdefault((int(info.offset), int(info.length)), []).append(item)
        return [(off, length, group) for (off, length), group in sorted(ranges.items())]

    def _read_items(self, name: str, items: list[ReadItem], planner: LoadPlanner) -> None:
        with self._open(name) as f:
            for offset, length, group in self._groups(items):
                f.seek(offset)
                data = f.read(length)
                if len(data) != length:
                    raise IntegrityError(
                        f"checkpoint {self.path}: {name} is truncated ({offset + len(data)} bytes where an item ends "
                        f"at {offset + length}); it was not loaded"
                    )
                try:
                    self._load(group, data, planner)
                except Exception as e:
                    raise self._undecodable(
                        f"{name}: an item at byte {offset} cannot be read ({type(e).__name__}: {_first_line(e)})"
                    ) from None

    def _undecodable(self, what: str) -> CheckpointReadError:
        """Bytes this process cannot decode, where no hash showed damage: a reader's problem, not the checkpoint's.

        Names the torch that wrote the checkpoint (from its manifest) and the one reading it, since a
        torch upgrade that changed the serialization is the usual cause.
        """
        try:
            versions = read_manifest(self.path)[0].get("versions") or {}
            wrote = str(versions.get("torch", "an unrecorded version"))
        except CheckpointError:
            wrote = "an unknown version (the manifest could not be read)"
        return CheckpointReadError(
            f"checkpoint {self.path} could not be decoded -- {what}; its files match their recorded hashes (or were "
            f"not hashed), so this is not damage and nothing was moved aside. It was written with torch {wrote}; "
            f"this process runs torch {torch.__version__}. Load it with the torch version that wrote it (or a "
            "compatible one), or report the decoding error."
        )

    def _read_hashing(
        self, name: str, items: list[ReadItem], planner: LoadPlanner, problems: list[FileProblem]
    ) -> None:
        entry = self._mine.get(name)
        if entry is None:
            problems.append(FileProblem(name, "unexpected", "read by DCP but not listed in the manifest"))
            return
        file = self._root / name
        local = self._store.local_file(file)
        mapping = None if local is None else self._map(local)
        if mapping is None:  # an object, or a file system that cannot map files (some FUSE and network mounts)
            actual, size, unreadable = self._stream_hashing(name, items, planner, problems)
        else:
            actual, size, unreadable = self._map_hashing(file.name, mapping, items, planner, problems)
        if actual is None:
            return
        self.hashed[name] = actual
        if size != int(entry["bytes"]):
            problems.append(FileProblem(name, "altered", f"size {size} bytes, manifest records {entry['bytes']}"))
        elif actual != entry["sha256"]:
            problems.append(FileProblem(name, "altered", f"sha256 {actual}, manifest records {entry['sha256']}"))
        elif unreadable is not None:  # it matches the manifest, yet does not deserialize: a writer's bug, not damage
            problems.append(FileProblem(name, "unreadable", unreadable))

    @staticmethod
    def _map(file: Path) -> mmap.mmap | bytes | None:
        """``file`` mapped read-only (``b""`` when it is empty), or None where the file system cannot map it."""
        with open(file, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                return b""
            try:
                return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except OSError as e:
                if e.errno in (errno.ENODEV, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EACCES):
                    return None
                raise

    def _map_hashing(
        self,
        name: str,
        mapping: mmap.mmap | bytes,
        items: list[ReadItem],
        planner: LoadPlanner,
        problems: list[FileProblem],
    ) -> tuple[str | None, int, str | None]:
        """A local file, mapped read-only: ``(sha256, size, why an item could not be decoded)``.

        Note: one pass over the page cache, no copy. The whole file is hashed on a helper thread
        straight from the mapping while this thread decodes each item from the same pages and
        copies it into its target, so the bytes are never copied into a buffer first (a read's
        memcpy and its fresh pages cost about as much as the decoding). The kernel is told the
        file is read once, in order (``MADV_SEQUENTIAL``), so a cold file streams in by aggressive
        readahead under both threads.
        A file truncated by another process while mapped would fault (SIGBUS); checkpoint files
        are written once and never truncated in place -- shardline's own deletions unlink, which
        leaves a mapping intact.
        """
        size = len(mapping)
        view = memoryview(mapping)
        try:
            # (not WILLNEED: queueing the whole file's reads up front costs more than readahead)
            if isinstance(mapping, mmap.mmap) and hasattr(mmap, "MADV_SEQUENTIAL"):
                mapping.madvise(mmap.MADV_SEQUENTIAL)
            digest = hashlib.sha256()
            pending = hasher_pool().submit(digest.update, view)
            unreadable: str | None = None
            try:
                pos = 0
                for offset, length, group in self._groups(items):
                    if offset < pos:
                        problems.append(FileProblem(name, "altered", f"items overlap at byte {offset}"))
                        return None, size, None
                    if offset + length > size:
                        break  # a short file: the size check reports it
                    pos = offset + length
                    if unreadable is not None:
                        continue
                    try:
                        self._load(group, view[offset : offset + length], planner)
                    except Exception as e:
                        unreadable = f"an item at byte {offset} cannot be read ({type(e).__name__}: {_first_line(e)})"
            finally:
                pending.result()
            return digest.hexdigest(), size, unreadable
        finally:
            with contextlib.suppress(BufferError):
                view.release()
            if isinstance(mapping, mmap.mmap):
                with contextlib.suppress(BufferError):  # a decoded view still alive: the mapping goes with it
                    mapping.close()

    def _stream_hashing(
        self, name: str, items: list[ReadItem], planner: LoadPlanner, problems: list[FileProblem]
    ) -> tuple[str | None, int, str | None]:
        """An object, read in one sequential streamed pass: ``(sha256, size, why an item could not be decoded)``."""
        digest = hashlib.sha256()
        pool = hasher_pool()
        pos = 0
        short = False
        unreadable: str | None = None  # once an item fails to deserialize, the rest is only hashed
        # Note: the digest of item k runs on a helper thread while this thread deserializes item k and
        # reads item k+1; it is waited for only before the next update, so updates stay in file order and
        # hashing overlaps both decoding and the download.
        pending: concurrent.futures.Future[None] | None = None
        try:
            with self._open(name) as f:
                for offset, length, group in self._groups(items):
                    if offset < pos:
                        problems.append(FileProblem(name, "altered", f"items overlap at byte {offset}"))
                        return None, 0, None
                    if offset > pos:
                        _settle(pending)
                        pending = None
                        pos = self._hash_span(f, digest, pos, offset)
                    data = f.read(length)
                    if len(data) != length:
                        short = True
                        break
                    _settle(pending)
                    pending = None
                    if length >= _OVERLAP_MIN:
                        pending = pool.submit(digest.update, data)
                    else:
                        digest.update(data)
                    try:
                        if unreadable is None:
                            self._load(group, data, planner)
                    except Exception as e:
                        unreadable = f"an item at byte {offset} cannot be read ({type(e).__name__}: {_first_line(e)})"
                    pos += length
                _settle(pending)
                pending = None
                if not short:
                    pos = self._hash_span(f, digest, pos, None)
        finally:
            _settle(pending)
        size = (self._root / name).stat().st_size
        if short:  # the file ended inside an item: whatever its size, it is not what the manifest records
            recorded = self._mine[name]["bytes"]
            problems.append(FileProblem(name, "altered", f"size {size} bytes, manifest records {recorded}"))
            return None, size, None
        return digest.hexdigest(), size, unreadable

    @staticmethod
    def _hash_span(f: BinaryIO, digest: hashlib._Hash, pos: int, end: int | None) -> int:
        """Read and hash from ``pos`` to ``end`` (to the end of the file when None); returns the new position."""
        while end is None or pos < end:
            chunk = f.read(_CHUNK if end is None else min(_CHUNK, end - pos))
            if not chunk:
                break
            digest.update(chunk)
            pos += len(chunk)
        return pos

    def _load(self, group: list[ReadItem], data: bytes | memoryview, planner: LoadPlanner) -> None:
        # The group's items all read one stored tensor: decode it once, as a view of ``data`` (no copy,
        # no torch.load; see tensor_record.py), or leave it None for torch.load when that declines.
        decoded: torch.Tensor | None = None
        tried = False
        for item in group:
            info = self.storage_data[item.storage_index]
            descriptors = getattr(info, "transform_descriptors", None) or ()
            stream: Any = None
            if descriptors:  # DCP extensions (e.g. compression); shardline writes none
                stream = self.transforms.transform_load_stream(item, descriptors, io.BytesIO(data))
            if item.type == LoadItemType.BYTE_IO:
                value = io.BytesIO(stream.read(-1) if stream is not None else bytes(data))
                with self._planner_lock:
                    planner.load_bytes(item, value)
                continue
            if stream is None and not tried:
                decoded, tried = decode_tensor(data), True
            if stream is None and decoded is not None:
                stored = decoded
            else:
                stream = stream if stream is not None else io.BytesIO(data)  # (a copy of a mapped view: a fallback)
                if not stream.seekable():
                    stream = io.BytesIO(stream.read(-1))
                stored = torch.load(stream, map_location="cpu", weights_only=True)
            tensor = _narrow(stored, item.storage_offsets, item.lengths)
            with self._planner_lock:
                target = planner.resolve_tensor(item).detach()
            if target.size() != tensor.size():
                raise IntegrityError(
                    f"checkpoint {self.path}: item {item.storage_index.fqn} has shape {tuple(tensor.size())} where its "
                    f"metadata promises {tuple(target.size())}"
                )
            target.copy_(tensor)  # items never overlap in their target, so files on other threads copy alongside
            with self._planner_lock:
                planner.commit_tensor(item, target)
