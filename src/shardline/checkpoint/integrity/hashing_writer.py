"""A DCP ``StorageWriter`` that reports the SHA-256 of every file it wrote to rank 0, with no extra collective.

Note: how the digests travel (the hashing itself is :mod:`.hashing`'s file system).

* ``write_data`` writes a rank's items through the :class:`~.hashing.HashingFileSystem`, raises
  the first ``OSError`` a writer thread kept (and checks that every planned item was written),
  and returns DCP's ``WriteResult`` list, which DCP already gathers to the coordinator for
  ``finish``. We append one extra ``WriteResult`` per file written, whose index is
  ``__shardline_file_digest__/<file name>`` and whose ``storage_data`` is a compact record, the
  tuple ``(path, rank, bytes, sha256)``: the digests ride to rank 0 in that gather (at 16,384
  ranks x 8 files, 131k of them: a tuple pickles smaller and becomes a ``FileDigest`` faster
  than a dict; a dict ``{path, rank, bytes, sha256}`` from an older writer is still read).
* ``finish`` (coordinator only) takes the digest records out again before handing the
  results to DCP's own ``finish``, so ``.metadata`` holds exactly what plain torch writes and
  stays loadable without shardline. ``.metadata`` itself is written through the hashing
  file system, so its digest is known too.
"""

from __future__ import annotations

import contextvars
import dataclasses
import io
import math
import os
from collections.abc import Callable
from typing import Any, cast

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future as TorchFuture

from shardline import _torch_compat
from shardline.checkpoint.coordination.parallelism import AUTO, cores_per_rank, files_for_share, resolve_files_per_rank
from shardline.checkpoint.faults.observer import NO_OBSERVER, SaveObserver, SavePhase
from shardline.checkpoint.format.packed_layout import is_segment_key
from shardline.checkpoint.integrity.digest_queue import RetainedMemory
from shardline.checkpoint.integrity.hashing import FileDigest, HashingFileSystem
from shardline.checkpoint.storage.calibration import SaveTuning
from shardline.checkpoint.storage.protocol import Location
from shardline.checkpoint.storage.stores import locate, store_for
from shardline.errors import CheckpointError, IntegrityError

__all__ = ["DIGEST_INDEX_PREFIX", "HashingWriter", "digest_result", "split_digests"]

DIGEST_INDEX_PREFIX = "__shardline_file_digest__/"


class _RetainingPlanner:
    """The save planner, seen by DCP's writer threads through this: every CPU tensor it resolves is retained.

    Note: so a file's hash may trail its write (:mod:`.digest_queue`). torch.save writes a
    tensor's storage straight from its memory; holding the tensor until every file is hashed
    makes that memory safe to hash after ``write`` returned. A tensor that does not own its whole
    storage is cloned here, as DCP's own loader would clone it (torch.save writes whole
    storages), so DCP writes the retained clone rather than one of its own.
    """

    def __init__(self, planner: SavePlanner, retained: RetainedMemory) -> None:
        self._planner = planner
        self._retained = retained

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        # DCP resolves each item on the writer thread that then torch.saves it: that thread's records skip the
        # CRC-32, which the file's SHA-256 supersedes (_torch_compat.skip_save_crc32_here says why and where).
        _torch_compat.skip_save_crc32_here()
        data = self._planner.resolve_data(write_item)
        if is_segment_key(write_item.index.fqn):
            # Note: a packed segment is assembled for this write alone; retaining it until the files are hashed
            # would hold a second copy of the rank's state. Unretained, its bytes are hashed as they are written.
            return data
        if isinstance(data, torch.Tensor) and data.device.type == "cpu":
            data = data.detach()
            if data.untyped_storage().nbytes() != data.nbytes:
                data = data.clone()
            self._retained.keep(data)
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)


def _nbytes(item: WriteItem) -> int:
    """The bytes of a tensor item (a bytes item, the trainer state or the config, counts as none)."""
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        return 0
    return math.prod(item.tensor_data.chunk.sizes) * item.tensor_data.properties.dtype.itemsize


def _is_digest(result: WriteResult) -> bool:
    return result.index.fqn.startswith(DIGEST_INDEX_PREFIX)


def digest_result(record: FileDigest) -> WriteResult:
    """The extra ``WriteResult`` that carries one written file's digest to the coordinator in DCP's gather."""
    return WriteResult(
        index=MetadataIndex(DIGEST_INDEX_PREFIX + record.path),
        size_in_bytes=record.bytes,
        storage_data=(record.path, record.rank, record.bytes, record.sha256),
    )


def _record(data: Any) -> FileDigest:
    """The ``FileDigest`` of a digest result's ``storage_data``: the tuple ``digest_result`` writes, or the dict
    earlier writers sent."""
    return FileDigest(**data) if isinstance(data, dict) else FileDigest(*data)


def split_digests(results: list[list[WriteResult]]) -> tuple[list[list[WriteResult]], dict[str, FileDigest]]:
    """The coordinator's part of ``finish`` before DCP's own: every rank's results without the digest records
    (what DCP's ``finish`` gets), and the digest records by file name.

    Note: ``write_data`` appends a rank's digest records after all of DCP's results, and DCP's gather
    keeps each rank's list as that rank returned it, so the records are taken from each list's end:
    the scan stops at the first of DCP's results (35M of them at 16,384 ranks, each examined before)
    and the rest of the list is kept as one slice.

    Raises:
        CheckpointError: two ranks reported the same file.
    """
    digests: dict[str, FileDigest] = {}
    clean: list[list[WriteResult]] = []
    for rank_results in results:
        end = len(rank_results)
        while end and rank_results[end - 1].index.fqn.startswith(DIGEST_INDEX_PREFIX):
            end -= 1
        clean.append(rank_results[:end])
        for r in rank_results[end:]:
            data = r.storage_data
            record = FileDigest(*data) if type(data) is tuple else _record(data)
            if record.path in digests:
                raise CheckpointError(
                    f"two ranks ({digests[record.path].rank} and {record.rank}) reported writing "
                    f"{record.path!r}; checkpoint file names must be unique per rank"
                )
            digests[record.path] = record
    return clean, digests


class HashingWriter(FileSystemWriter):
    """``FileSystemWriter`` (``files_per_rank`` files per rank, fsynced) that reports each file's SHA-256 to rank 0.

    Each of a rank's files (``__{rank}_{n}.distcp``; in a bucket under ``shards/GGGG/``) is written by its own DCP
    writer thread, which hashes it on the way (:mod:`.parallelism`).

    After ``torch.distributed.checkpoint.save`` returns, :attr:`file_digests` holds, on the
    coordinator only, every file of the checkpoint (``.metadata`` included), sorted by path.

    Args:
        path: The directory to write (the temporary directory of a save).
        final_path: Where the directory will be renamed to; recorded as the checkpoint id in
            ``.metadata``'s storage metadata instead of the temporary path.
        observer: Told of every write and of the ``after_shards`` phase (tests inject faults here).
        check_written: Called on each rank after its files are written, with (directory, plan, planner,
            write results); returns problems, and any fails the save. An async save passes the check
            that the bytes written are the bytes staged (:mod:`.copy_check`).
        files_per_rank: Files each rank writes (0: automatic, from the cores each rank has and the
            size of its share); never more than the rank has items.
        sync_later: False: every file is fsynced before ``torch.distributed.checkpoint.save`` returns,
            as DCP does. True, for a caller that fsyncs its own commit records (the save's
            ``_finalize``): the coordinator's data files are fsynced in the background from their
            close on, so the flush overlaps the gather, ``.metadata`` and the records (``.metadata``'s
            own flush too). The caller must then call :meth:`wait_synced` before it commits. Other
            ranks still flush before their ``write_data`` returns: the coordinator cannot wait for
            another process's flush.

    Raises:
        ConfigurationError: ``files_per_rank`` is not a count.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | Location,
        *,
        final_path: str | os.PathLike[str] | Location | None = None,
        observer: SaveObserver = NO_OBSERVER,
        check_written: Callable[[Location, SavePlan, SavePlanner, list[WriteResult]], list[str]] | None = None,
        files_per_rank: int = AUTO,
        sync_later: bool = False,
    ) -> None:
        resolve_files_per_rank(files_per_rank)
        self.files_per_rank = files_per_rank
        # The store says how the files are written: local files fsynced as they close; in an object store,
        # uploads DCP addresses by bucket-relative key, durable once the store acknowledges them (no descriptor).
        location = locate(path)
        files = store_for(location).save_files(location)
        # DCP's own fsyncs are off: our streams flush each file as they close it (after starting its hash).
        super().__init__(files.root, single_file_per_rank=True, sync_files=False, thread_count=1, overwrite=False)
        self._files = files
        self.tuning: SaveTuning | None = None  # this rank's, once write_data has run
        self._hfs = HashingFileSystem(observer, files=files)
        self._observer = observer
        _torch_compat.set_writer_filesystem(self, self._hfs)
        self._final_path = final_path
        self._check_written = check_written
        self._location = location
        self._sync_later = sync_later
        self._is_coordinator = True
        self.file_digests: list[FileDigest] | None = None

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=str(self._final_path or self.path), save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        self._hfs.rank = self.rank or 0
        self._is_coordinator = is_coordinator

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # Each rank's files are named where the store puts them: flat on disk (DCP's ``__R_``), spread over key
        # prefixes in a bucket (``shards/GGGG/__R_``); the relative paths land in .metadata and the manifest.
        # DCP's own plan gives plan i the storage prefix record ``__i_``; only its text changes here.
        planned = super().prepare_global_plan(plans)
        return [
            dataclasses.replace(
                plan, storage_data=dataclasses.replace(plan.storage_data, prefix=self._files.data_prefix(i))
            )
            if plan is not given and getattr(plan.storage_data, "prefix", None) == f"__{i}_"
            else plan
            for i, (plan, given) in enumerate(zip(planned, plans, strict=True))
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> TorchFuture[list[WriteResult]]:
        self._hfs.start()
        rank = self.rank or 0
        # One file per writer thread (DCP's thread_count), as parallelism.py decides for this rank's share.
        share = sum(_nbytes(item) for item in plan.items)
        self.thread_count = files_for_share(self.files_per_rank, share_bytes=share, items=len(plan.items))
        # Whether each file is hashed as it is written or from its fsync on, and how early its writeback starts: as
        # the store decides for this rank's writers and cores (for local files, measured once per file system).
        self.tuning = self._files.tuning(writers=self.thread_count, cores=cores_per_rank())
        self._hfs.hash_eagerly = self.tuning.hash_during_writes
        self._hfs.writeback_every = self.tuning.writeback_every
        self._hfs.sync_later = self._sync_later and self._is_coordinator
        try:
            # _RetainingPlanner answers every SavePlanner method (it forwards those it does not override).
            retaining = cast(SavePlanner, _RetainingPlanner(planner, self._hfs.retained))
            # In a copy of the caller's context: the CRC-32 switch that resolve_data sets on each writer thread (DCP
            # writes a file on the calling thread too) is gone when this returns, so the caller's torch.save keeps it.
            results = list(contextvars.copy_context().run(super().write_data, plan, retaining).wait())
        except Exception:
            self._hfs.abandon()
            errors = self._hfs.take_errors()
            if errors:  # the OS error behind DCP's (or torch.save's) own, e.g. "unexpected pos ..." for a full disk
                raise errors[0] from None
            raise
        finally:
            self._hfs.retained.release()  # every stream is closed, so every file is hashed
        errors = self._hfs.take_errors()
        if errors:  # DCP's extra writer threads end silently on an error: their files are incomplete
            raise errors[0]
        missing = {item.index for item in plan.items} - {r.index for r in results}
        if missing:
            first = min(missing, key=lambda index: index.fqn).fqn
            raise CheckpointError(
                f"rank {rank} wrote {len(plan.items) - len(missing)} of its {len(plan.items)} checkpoint items "
                f"({first!r} among those missing): a writer thread failed, so this checkpoint is not committed"
            )
        written = self._hfs.take()
        if self._check_written is not None:
            problems = self._check_written(self._location, plan, planner, results)
            if problems:
                more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
                raise IntegrityError(
                    f"rank {rank} wrote bytes that differ from what it staged -- {problems[0]}{more}; the "
                    "staged copy changed before it was written (a torn write), so this checkpoint is not committed"
                )
        self._observer.on_phase(SavePhase.AFTER_SHARDS, rank)
        for full, (size, digest) in sorted(written.items()):
            name = os.path.relpath(full, self.path)
            results.append(digest_result(FileDigest(path=name, rank=rank, bytes=size, sha256=digest)))
        fut: TorchFuture[list[WriteResult]] = TorchFuture()
        fut.set_result(results)
        return fut

    def wait_synced(self) -> None:
        """With ``sync_later``: wait until this rank's background fsyncs are done; raise the first that failed."""
        self._hfs.wait_synced()

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        clean, digests = split_digests(results)
        self._hfs.take()
        # Note: DCP's own fsync of .metadata stays off (sync_files=False): .metadata is written through a hashing
        # stream, whose close fsyncs it (in the background with sync_later) -- a second fsync would flush nothing.
        super().finish(metadata, clean)
        for full, (size, digest) in self._hfs.take().items():
            name = os.path.relpath(full, self.path)
            digests[name] = FileDigest(path=name, rank=self.rank or 0, bytes=size, sha256=digest)
        # Every file .metadata points into must be one we hashed.
        referenced = {getattr(info, "relative_path", None) for info in (metadata.storage_data or {}).values()}
        unhashed = sorted(p for p in referenced if p is not None and p not in digests)
        if unhashed or ".metadata" not in digests:
            raise CheckpointError(
                f"internal error: files written without a digest: {unhashed or ['.metadata']}; "
                "the torch version may have changed how FileSystemWriter opens files"
            )
        self.file_digests = sorted(digests.values())
