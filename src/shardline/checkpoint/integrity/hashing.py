"""Streams and a DCP ``FileSystem`` that SHA-256-hash every file in the same pass that writes it.

Note: how it plugs into torch.distributed.checkpoint (the writer itself is :mod:`.hashing_writer`).

* ``FileSystemWriter`` opens every file it writes -- each rank's ``__{rank}_{n}.distcp`` and the
  coordinator's ``.metadata`` -- through its ``FileSystem``'s ``create_stream``. We give it a
  :class:`HashingFileSystem` whose write streams feed each buffer to a SHA-256 hasher on its way
  to the file, so no file is ever read back. DCP only writes sequentially (it asks ``tell()``
  for offsets, never seeks); a seek raises, since the digest would no longer describe the file.
  The files themselves are the store's (:meth:`.CheckpointStore.save_files`): local files,
  or uploads to an object store.
* DCP writes a rank's items into ``thread_count`` files, one writer thread each
  (:mod:`.parallelism` picks the count); each thread's stream hashes its own file. DCP's extra
  threads end silently on an error, so the streams keep every ``OSError`` they raise and the
  writer raises the first one: a full disk is named as such even where torch.save's C++ writer
  would report only "unexpected pos".
"""

from __future__ import annotations

import hashlib
import io
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from torch.distributed.checkpoint.filesystem import FileSystem

from shardline.checkpoint.coordination.parallelism import available_cores
from shardline.checkpoint.faults.observer import NO_OBSERVER, SaveObserver
from shardline.checkpoint.integrity.digest_queue import OrderedDigest, RetainedMemory
from shardline.checkpoint.storage.calibration import DEFAULT_WRITEBACK_EVERY
from shardline.checkpoint.storage.fsutil import fsync_pool, start_writeback
from shardline.checkpoint.storage.local import LocalFiles
from shardline.checkpoint.storage.protocol import Location, SaveFiles
from shardline.checkpoint.storage.writeback import BackgroundWriteback
from shardline.errors import CheckpointError

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["FileDigest", "HashingFileSystem", "hasher_pool", "sha256_file"]

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


def sha256_file(path: Location) -> tuple[int, str]:
    """``(size, hex sha256)`` of a file or object, read in chunks (for verification, never during a save)."""
    h = hashlib.sha256()
    size = 0
    with path.open("rb") as f:
        while chunk := f.read(_READ_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


# Smaller buffers are gathered into one block before they join a file's hash queue.
_COALESCE_MAX = 64 << 10
# A local file's writeback is started every this many bytes written (see _HashingStream); None: never. The
# default of a HashingFileSystem; a save's writer sets its own from the location's calibration.
_WRITEBACK_EVERY: int | None = DEFAULT_WRITEBACK_EVERY
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
    (:func:`~shardline.checkpoint.storage.fsutil.start_writeback`, asked for on the fsync threads:
    :mod:`~shardline.checkpoint.storage.writeback`), and is fsynced by ``close``
    through ``sync``: at once, or in the background for a save that waits for it before its
    commit (``HashingWriter(sync_later=True)``). The hash queue starts before that fsync.
    """

    def __init__(
        self,
        raw: BinaryIO,
        on_close: Callable[[int, str], None],
        hasher_pool: ThreadPoolExecutor,
        before_write: Callable[[int], None] | None,
        on_error: Callable[[OSError], None],
        retained: RetainedMemory | None = None,
        *,
        eager: bool = False,
        sync: Callable[[int], None] | None = None,
        writeback_every: int | None = _WRITEBACK_EVERY,
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
        # A local file, fsynced at close: its writeback starts early (unless writeback_every is None).
        self._writeback_every = writeback_every if sync is not None else None
        self._flushing = 0  # bytes handed to the OS's writeback so far
        self._writeback: BackgroundWriteback | None = None  # the file's hints, asked for off this thread

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def write(self, data: Buffer) -> int:
        view = memoryview(data).cast("B")
        try:
            if self._before_write is not None:
                self._before_write(len(view))
        except OSError as e:
            self._on_error(e)
            raise
        try:
            if len(view) <= _COALESCE_MAX:  # a block of gathered small writes is at most this long
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
        # Ask the OS to start writing what reached it so far, so the fsync at close finds most of the file on its way
        # already. The call itself runs on the fsync threads (storage/writeback.py): on a busy disk it can wait for
        # room in the disk's queue, and this thread would copy nothing meanwhile. A file system that cannot is not
        # asked again.
        self._flush_raw()
        if self._writeback is None:
            self._writeback = BackgroundWriteback(self._raw.fileno(), start=start_writeback)
        if not self._writeback.request(offset=self._flushing, length=self._size - self._flushing):
            self._writeback_every = None
        self._flushing = self._size

    def _end_writeback(self) -> None:
        # Before the fsync (which writes whatever no hint reached) and whenever the stream closes.
        if self._writeback is not None:
            self._writeback.close()

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

    def seek(self, *_args: object) -> int:
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
                self._end_writeback()
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
            self._end_writeback()
            super().close()


class _GatheredWrites(io.BufferedWriter):
    """What DCP writes into: gathers torch.save's small writes in C before they reach the hashing stream.

    Note: torch.save writes each tensor as some forty writes of a few bytes around one of its
    storage; each through :class:`_HashingStream`'s Python ``write`` cost about 0.5 us at idle and
    several times that under load (1,250 per 192 MiB). Gathered here, the stream sees one block per
    64 KiB of them; a write larger than the free space (a tensor's storage) still reaches it as is,
    a view of the caller's memory, so a retained tensor is queued without a copy as before.
    """

    def fileno(self) -> int:
        # DCP fsyncs through fileno() without a flush: what is gathered here must reach the file first.
        self.flush()
        return super().fileno()


class HashingFileSystem(FileSystem):
    """DCP's ``FileSystem`` whose write streams record ``(bytes, sha256)`` of each file on close.

    The files themselves are the store's (``files``, :meth:`.CheckpointStore.save_files`: local
    files by default). Every write is announced to ``observer.before_write`` first (a test may make
    it fail the way a full disk does); ``rank`` names the writing rank to it.
    """

    def __init__(self, observer: SaveObserver = NO_OBSERVER, *, files: SaveFiles | None = None) -> None:
        super().__init__()
        self._files = files if files is not None else LocalFiles()
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
        self.hash_eagerly = self._files.uploads
        # A local file's writeback is started every this many bytes (None: left to its fsync); the writer sets
        # both from the location's calibration (storage/calibration.py).
        self.writeback_every: int | None = _WRITEBACK_EVERY
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
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
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
                raw = self._files.open_write(key)  # closed by the stream, whose close may itself fail
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
                sync=self._sync_file(failed) if self._files.fsync else None,
                writeback_every=self.writeback_every,
            )
            buffered = _GatheredWrites(stream, buffer_size=_COALESCE_MAX)
            try:
                yield buffered
            finally:
                try:
                    try:
                        buffered.close()  # flushes what it gathered into the stream, then closes it
                    finally:
                        stream.close()  # a no-op once closed; after a failed flush it still ends the hashing
                finally:
                    raw.close()  # a no-op once the stream closed it; after a failed flush it frees the descriptor
            self._files.written(key)
        finally:
            with self._open:
                self._active -= 1
                self._open.notify_all()

    @property
    def uploads(self) -> bool:
        """True when files are uploaded (writes wait on a network) rather than written locally."""
        return self._files.uploads

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

    # Path operations DCP's writer asks for, answered by the store's files (keys "bucket/prefix/name" in a store).
    def concat_path(self, path: str | os.PathLike[str], suffix: str) -> str | os.PathLike[str]:
        return self._files.join(path, suffix)

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        self._files.mkdir(path)

    def exists(self, path: str | os.PathLike[str]) -> bool:
        return self._files.exists(path)

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        self._files.rename(path, new_path)
        with self._lock:
            if str(Path(path)) in self._digests:
                self._digests[str(Path(new_path))] = self._digests.pop(str(Path(path)))

    def rm_file(self, path: str | os.PathLike[str]) -> None:
        self._files.remove(path)
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
