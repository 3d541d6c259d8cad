"""A DCP ``StorageWriter`` that SHA-256-hashes every file in the same pass that writes it.

Note: how it plugs into torch.distributed.checkpoint.

* ``FileSystemWriter`` opens every file it writes -- each rank's ``__{rank}_{n}.distcp`` and the
  coordinator's ``.metadata`` -- through its ``FileSystem``'s ``create_stream``. We give it a
  :class:`HashingFileSystem` whose write streams feed each buffer to a SHA-256 hasher on its way
  to the file, so no file is ever read back. DCP only writes sequentially (it asks ``tell()``
  for offsets, never seeks); a seek raises, since the digest would no longer describe the file.
* DCP writes a rank's items into ``thread_count`` files, one writer thread each
  (:mod:`.parallelism` picks the count); each thread's stream hashes its own file. DCP's extra
  threads end silently on an error, so the streams keep every ``OSError`` they raise and
  ``write_data`` raises the first one (and checks that every planned item was written): a full
  disk is named as such even where torch.save's C++ writer would report only "unexpected pos".
* ``write_data`` returns DCP's ``WriteResult`` list, which DCP already gathers to the
  coordinator for ``finish``. We append one extra ``WriteResult`` per file written, whose
  index is ``__shardline_file_digest__/<file name>`` and whose ``storage_data`` is a plain dict
  ``{path, rank, bytes, sha256}``: the digests ride to rank 0 in that gather, with no extra
  collective.
* ``finish`` (coordinator only) takes the digest records out again before handing the
  results to DCP's own ``finish``, so ``.metadata`` holds exactly what plain torch writes and
  stays loadable without shardline. ``.metadata`` itself is written through the hashing
  file system, so its digest is known too.
"""

from __future__ import annotations

import hashlib
import io
import math
import os
import posixpath
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future as TorchFuture

from shardline import _torch_compat
from shardline.checkpoint.coordination.parallelism import (
    AUTO,
    available_cores,
    cores_per_rank,
    files_for_share,
    resolve_files_per_rank,
)
from shardline.checkpoint.faults.crashpoints import crash_point
from shardline.checkpoint.faults.observer import NO_OBSERVER, SaveObserver, SavePhase
from shardline.checkpoint.integrity.digest_queue import OrderedDigest, RetainedMemory
from shardline.checkpoint.storage.fsutil import fsync_pool, start_writeback
from shardline.checkpoint.storage.objects import ObjectPath, delete_object
from shardline.errors import CheckpointError, IntegrityError

__all__ = ["DIGEST_INDEX_PREFIX", "FileDigest", "HashingFileSystem", "HashingWriter", "hasher_pool", "sha256_file"]

DIGEST_INDEX_PREFIX = "__shardline_file_digest__/"
_READ_CHUNK = 8 << 20


@dataclass(frozen=True, order=True)
class FileDigest:
    """One checkpoint file as written: name relative to the checkpoint, writing rank, size, SHA-256."""

    path: str
    rank: int
    bytes: int
    sha256: str

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "rank": self.rank, "bytes": self.bytes, "sha256": self.sha256}


def sha256_file(path: Path | ObjectPath) -> tuple[int, str]:
    """``(size, hex sha256)`` of a file or object, read in chunks (for verification, never during a save)."""
    h = hashlib.sha256()
    size = 0
    with path.open("rb") if isinstance(path, ObjectPath) else open(path, "rb") as f:
        while chunk := f.read(_READ_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


# Smaller buffers are gathered into one block before they join a file's hash queue.
_COALESCE_MAX = 64 << 10
# A local file's writeback is started every this many bytes written (see _HashingStream); None: never
# (the save benchmark's comparison of the hashing and commit alone).
_WRITEBACK_EVERY: int | None = 4 << 20
_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def hasher_pool() -> ThreadPoolExecutor:
    """The process's SHA-256 helper threads (shared by saves and verified loads).

    One per core this process may use, at least two: each of a rank's writer or reader threads
    hands its large buffers to them, so several files are hashed at once (threads start lazily).
    """
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=max(2, available_cores()), thread_name_prefix="shardline-sha256")
        return _POOL


def _forget_pool() -> None:
    # A forked child (a crash test's writer, a data loader worker) has none of the parent's threads.
    global _POOL, _POOL_LOCK
    _POOL, _POOL_LOCK = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)


class _HashingStream(io.RawIOBase):
    """A write-only stream that hashes every byte it passes on to ``raw``.

    Note: hashing trails the write (:mod:`.digest_queue`). A buffer that will keep its bytes
    -- an immutable ``bytes``, or a tensor storage in ``retained`` -- is queued for the hasher
    pool and ``write`` returns once the bytes are in the file. A local file's queue is hashed
    from its fsync on, which ``close`` starts (an upload's as it grows), and the digest is
    completed at ``close``, so the hash runs while the disk works. Any other large
    buffer is hashed on a helper thread while this thread writes it, and ``write`` waits for both
    (the caller may reuse it). Small ones are copied into one block that joins the queue when it
    fills or a large buffer follows: torch.save writes each tensor as some forty writes of a few
    bytes (zip headers, the pickle) around one of its storage, and queueing, locking and looking up
    each of those cost more than the copy. Updates stay in file order.

    A local file (``sync`` given) also has its writeback started every few MiB as it grows
    (:func:`~shardline.checkpoint.storage.fsutil.start_writeback`), and is fsynced by ``close``
    through ``sync``: at once, or in the background for a save that waits for it before its
    commit (``HashingWriter(sync_later=True)``). The hash queue starts before that fsync.
    """

    def __init__(
        self,
        raw: Any,
        on_close: Any,
        hasher_pool: ThreadPoolExecutor,
        before_write: Any,
        on_error: Any,
        retained: RetainedMemory | None = None,
        *,
        eager: bool = False,
        sync: Callable[[int], None] | None = None,
    ) -> None:
        super().__init__()
        self._raw = raw
        self._sync = sync
        self._on_close = on_close
        self._before_write = before_write
        self._on_error = on_error
        self._digest = OrderedDigest(hasher_pool, eager=eager)
        self._retained = retained
        self._size = 0
        self._small = bytearray()  # small buffers written since the last one queued
        # A local file, fsynced at close: its writeback starts early (unless _WRITEBACK_EVERY is None).
        self._writeback_every = _WRITEBACK_EVERY if sync is not None else None
        self._flushing = 0  # bytes handed to the OS's writeback so far

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        try:
            if self._before_write is not None:
                self._before_write(len(view))
        except OSError as e:
            self._on_error(e)
            raise
        try:
            if len(view) < _COALESCE_MAX:
                written = self._raw.write(view)  # a blocking file writes it all, or raises
                if written != len(view):
                    written = (written or 0) + self._write_all(view[written or 0 :])
                self._small += view
                if len(self._small) >= _COALESCE_MAX:
                    self._queue_small()
            elif isinstance(view.obj, bytes) or (self._retained is not None and self._retained.covers(view)):
                written = self._write_all(view)
                self._queue_small()
                self._digest.later(view)
            else:
                self._queue_small()
                written = self._digest.now(view, lambda: self._write_all(view))
        except OSError as e:
            # torch.save reaches this stream through C++, which swallows the exception and reports only
            # "unexpected pos": the error is kept here so the writer can raise the real cause (a full disk).
            self._on_error(e)
            raise
        self._size += written
        if self._writeback_every is not None and self._size - self._flushing >= self._writeback_every:
            self._start_writeback()
        return written

    def _start_writeback(self) -> None:
        # Ask the OS to start writing what reached it so far (it returns without waiting for the disk), so the
        # fsync at close finds most of the file on its way already. A file system that cannot is not asked again.
        self._flush_raw()
        if not start_writeback(self._raw.fileno(), offset=self._flushing, length=self._size - self._flushing):
            self._writeback_every = None
        self._flushing = self._size

    def _queue_small(self) -> None:
        if self._small:
            self._digest.later(bytes(self._small))
            self._small.clear()

    def _write_all(self, view: memoryview) -> int:
        written = 0
        while written < len(view):
            n = self._raw.write(view[written:])
            if n is None or n <= 0:  # a non-blocking raw file would do this; ours never is
                raise OSError(f"short write to checkpoint file ({written} of {len(view)} bytes)")
            written += n
        return written

    def tell(self) -> int:
        return self._size

    def seek(self, *_args: Any) -> int:
        raise io.UnsupportedOperation("checkpoint files are hashed while written and must be written sequentially")

    def fileno(self) -> int:
        # A caller asking for the descriptor may fsync it: Python's buffer must reach the OS first, and the
        # queued hashing starts, to run while the disk flushes.
        self._flush_raw()
        self._queue_small()
        self._digest.start()
        return self._raw.fileno()

    def flush(self) -> None:
        if not self._raw.closed:
            self._flush_raw()

    def _flush_raw(self) -> None:
        try:
            self._raw.flush()
        except OSError as e:
            self._on_error(e)
            raise

    def close(self) -> None:
        if self.closed:
            return
        try:
            self._flush_raw()
            if self._sync is not None:
                # The queued hashing starts first, so it runs while the disk flushes.
                self._queue_small()
                self._digest.start()
                try:
                    self._sync(self._raw.fileno())
                except OSError as e:
                    self._on_error(e)
                    raise
            try:
                self._raw.close()
            except OSError as e:
                self._on_error(e)
                raise
            self._queue_small()
            self._on_close(self._size, self._digest.hexdigest())
        finally:
            # A failed close leaves the queue unhashed: drop it, so no helper thread reads the retained
            # tensors after the writer releases them.
            self._digest.discard()
            super().close()


class HashingFileSystem(FileSystem):
    """DCP's local ``FileSystem`` whose write streams record ``(bytes, sha256)`` of each file on close.

    Every write is announced to ``observer.before_write`` first (a test may make it fail the way a
    full disk does); ``rank`` names the writing rank to it.
    """

    def __init__(self, observer: SaveObserver = NO_OBSERVER, *, objects: Any = None) -> None:
        super().__init__()
        self._objects = objects  # an fsspec file system: write objects to it instead of local files
        self._lock = threading.Lock()
        self._digests: dict[str, tuple[int, str]] = {}
        self._errors: list[OSError] = []
        self._open = threading.Condition(self._lock)
        self._active = 0  # write streams open now
        self._abandoned = False
        self.observer = observer
        self.rank = 0
        self.retained = RetainedMemory()  # the tensors of the write in progress (see _RetainingPlanner)
        # Hash each file as it is written (True) or from its fsync on (False): see digest_queue.py. An upload
        # waits on the network; local writer threads take a core each, so only fewer writers than cores
        # leave one free for hashing during the writes.
        self.hash_eagerly = objects is not None
        # Local files are fsynced as each stream closes; with sync_later, in the background (see HashingWriter).
        self.sync_later = False
        self._syncs: list[Future[None]] = []

    def _sync_file(self, failed: Callable[[OSError], None]) -> Callable[[int], None]:
        def sync(fd: int) -> None:
            if not self.sync_later:
                os.fsync(fd)
                return
            # The flush runs on its own descriptor (the stream closes its own at once), on the shared fsync threads.
            own = os.dup(fd)

            def flush() -> None:
                try:
                    os.fsync(own)
                except OSError as e:
                    failed(e)  # names the file
                    raise
                finally:
                    os.close(own)

            with self._lock:
                self._syncs.append(fsync_pool().submit(flush))

        return sync

    def wait_synced(self) -> None:
        """Wait for every background fsync started since the last call; raise the first that failed."""
        with self._lock:
            syncs, self._syncs = self._syncs, []
        first: BaseException | None = None
        for future in syncs:
            error = future.exception()
            if error is not None and first is None:
                first = error
        if first is not None:
            raise first

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        key = str(Path(path))

        def record(size: int, digest: str) -> None:
            with self._lock:
                self._digests[key] = (size, digest)

        def before_write(nbytes: int) -> None:
            self.observer.before_write(key, nbytes, self.rank)

        announce = None if self.observer is NO_OBSERVER else before_write

        def failed(error: OSError) -> None:
            if error.filename is None:
                error.filename = key
            with self._lock:
                self._errors.append(error)

        with self._open:
            if self._abandoned:
                raise CheckpointError(f"not writing {key}: another writer thread of this save failed")
            self._active += 1
        try:
            try:
                if self._objects is not None:  # an upload; close() completes it
                    raw = self._objects.open(key, "wb")
                else:
                    raw = open(key, "wb")  # noqa: SIM115 -- closed by the stream, whose close may itself fail
            except OSError as e:
                failed(e)
                raise
            stream = _HashingStream(
                raw,
                record,
                hasher_pool(),
                announce,
                failed,
                self.retained,
                eager=self.hash_eagerly,
                sync=self._sync_file(failed) if self._objects is None else None,
            )
            try:
                yield stream
            finally:
                try:
                    stream.close()
                finally:
                    raw.close()  # a no-op once the stream closed it; after a failed flush it frees the descriptor
            if self._objects is not None:
                crash_point("save.store_uploaded")
        finally:
            with self._open:
                self._active -= 1
                self._open.notify_all()

    @property
    def is_object_store(self) -> bool:
        """True when files are uploaded through fsspec rather than written locally."""
        return self._objects is not None

    def start(self) -> None:
        """Before a write: accept new files again, forget earlier errors and digests."""
        with self._open:
            self._abandoned = False
            self._errors = []
            self._digests = {}
            self._syncs = []

    def abandon(self, timeout: float = 300.0) -> None:
        """After a failed write: refuse new files and wait until every open one is closed.

        DCP raises the first writer thread's error without joining the others; the save removes
        the temporary directory only once nothing writes into it any more.
        """
        with self._open:
            self._abandoned = True
            self._open.wait_for(lambda: self._active == 0, timeout=timeout)

    # Path operations DCP's writer asks for: on an object store, keys ("bucket/prefix/name") through fsspec.
    def concat_path(self, path: str | os.PathLike, suffix: str) -> Any:
        if self._objects is None:
            return super().concat_path(path, suffix)
        return posixpath.join(str(path), suffix)

    def mkdir(self, path: str | os.PathLike) -> None:
        if self._objects is None:
            super().mkdir(path)  # an object store has no directories to make

    def exists(self, path: str | os.PathLike) -> bool:
        return bool(self._objects.exists(str(path))) if self._objects is not None else super().exists(path)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        if self._objects is not None:  # DCP's .metadata: a server-side copy, then a delete
            self._objects.copy(str(path), str(new_path))
            crash_point("save.store_metadata_copied")
            delete_object(self._objects, str(path))
        else:
            super().rename(path, new_path)
        with self._lock:
            if str(Path(path)) in self._digests:
                self._digests[str(Path(new_path))] = self._digests.pop(str(Path(path)))

    def rm_file(self, path: str | os.PathLike) -> None:
        if self._objects is not None:
            delete_object(self._objects, str(path))
        else:
            super().rm_file(path)
        with self._lock:
            self._digests.pop(str(Path(path)), None)

    def take(self) -> dict[str, tuple[int, str]]:
        """The digests recorded since the last ``take`` (full path -> (bytes, sha256)), and forget them."""
        with self._lock:
            out, self._digests = self._digests, {}
        return out

    def take_errors(self) -> list[OSError]:
        """The OS errors raised by writes since the last call (first first), and forget them."""
        with self._lock:
            out, self._errors = self._errors, []
        return out


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

    def resolve_data(self, write_item: WriteItem) -> Any:
        data = self._planner.resolve_data(write_item)
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


class HashingWriter(FileSystemWriter):
    """``FileSystemWriter`` (``files_per_rank`` files per rank, fsynced) that reports each file's SHA-256 to rank 0.

    Each of a rank's files (``__{rank}_{n}.distcp``) is written by its own DCP writer thread,
    which hashes it on the way (:mod:`.parallelism`).

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
            close on, so the flush overlaps the gather, ``.metadata`` and the records; ``.metadata``
            is not fsynced. The caller must then call :meth:`wait_synced` and fsync ``.metadata``
            before it commits. Other ranks still flush before their ``write_data`` returns: the
            coordinator cannot wait for another process's flush.

    Raises:
        ConfigurationError: ``files_per_rank`` is not a count.
    """

    def __init__(
        self,
        path: str | os.PathLike | ObjectPath,
        *,
        final_path: str | os.PathLike | ObjectPath | None = None,
        observer: SaveObserver = NO_OBSERVER,
        check_written: Callable[[Path | ObjectPath, SavePlan, SavePlanner, list[WriteResult]], list[str]] | None = None,
        files_per_rank: int = AUTO,
        sync_later: bool = False,
    ) -> None:
        resolve_files_per_rank(files_per_rank)
        self.files_per_rank = files_per_rank
        # An object store: DCP works on the bucket-relative key, our file system uploads through fsspec, and
        # nothing is fsynced (an upload is durable once the store acknowledges it; there is no descriptor).
        objects = path.fs if isinstance(path, ObjectPath) else None
        target = path.key if isinstance(path, ObjectPath) else path
        # DCP's own fsyncs are off: our streams flush each file as they close it (after starting its hash).
        super().__init__(target, single_file_per_rank=True, sync_files=False, thread_count=1, overwrite=False)
        self._durable = objects is None
        self._hfs = HashingFileSystem(observer, objects=objects)
        self._observer = observer
        _torch_compat.set_writer_filesystem(self, self._hfs)
        self._final_path = final_path
        self._check_written = check_written
        self._location: Path | ObjectPath = path if isinstance(path, ObjectPath) else Path(path)
        self._sync_later = sync_later
        self._is_coordinator = True
        self.file_digests: list[FileDigest] | None = None

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=str(self._final_path or self.path), save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        self._hfs.rank = self.rank or 0
        self._is_coordinator = is_coordinator

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> TorchFuture[list[WriteResult]]:
        self._hfs.start()
        rank = self.rank or 0
        # One file per writer thread (DCP's thread_count), as parallelism.py decides for this rank's share.
        share = sum(_nbytes(item) for item in plan.items)
        self.thread_count = files_for_share(self.files_per_rank, share_bytes=share, items=len(plan.items))
        self._hfs.hash_eagerly = self._hfs.is_object_store or self.thread_count < cores_per_rank()
        self._hfs.sync_later = self._sync_later and self._is_coordinator
        try:
            results = list(super().write_data(plan, _RetainingPlanner(planner, self._hfs.retained)).wait())
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
            record = FileDigest(path=name, rank=rank, bytes=size, sha256=digest)
            results.append(
                WriteResult(
                    index=MetadataIndex(DIGEST_INDEX_PREFIX + name), size_in_bytes=size, storage_data=record.to_json()
                )
            )
        fut: TorchFuture[list[WriteResult]] = TorchFuture()
        fut.set_result(results)
        return fut

    def wait_synced(self) -> None:
        """With ``sync_later``: wait until this rank's background fsyncs are done; raise the first that failed."""
        self._hfs.wait_synced()

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        digests: dict[str, FileDigest] = {}
        clean: list[list[WriteResult]] = []
        for rank_results in results:
            clean.append([r for r in rank_results if not _is_digest(r)])
            for r in rank_results:
                if _is_digest(r):
                    record = FileDigest(**r.storage_data)
                    if record.path in digests:
                        raise CheckpointError(
                            f"two ranks ({digests[record.path].rank} and {record.rank}) reported writing "
                            f"{record.path!r}; checkpoint file names must be unique per rank"
                        )
                    digests[record.path] = record
        self._hfs.take()
        self.sync_files = self._durable and not self._sync_later  # DCP's fsync of .metadata
        try:
            super().finish(metadata, clean)
        finally:
            self.sync_files = False
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
