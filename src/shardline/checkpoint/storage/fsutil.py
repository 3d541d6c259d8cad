"""Durable file-system steps of the commit protocol: fsync, atomic small-file writes, temp names."""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import re
import sys
import threading
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from shardline.checkpoint.faults.crashpoints import crash_point

__all__ = [
    "TMP_PATTERN",
    "TRASH_PATTERN",
    "atomic_write_bytes",
    "fsync_dir",
    "fsync_file",
    "fsync_new_dirs",
    "fsync_pool",
    "fsync_together",
    "is_tmp_lock_name",
    "is_tmp_name",
    "is_trash_name",
    "lock_tmp",
    "release_tmp",
    "start_writeback",
    "tmp_dir_for",
    "tmp_in_use",
    "trash_dir_for",
    "write_unflushed",
]

# Temporary directories of saves in progress: ".step-100.tmp-<hex>" next to the final "step-100".
TMP_PATTERN = re.compile(r"^\.(?P<final>.+)\.tmp-[0-9a-f]{12}$")


# Checkpoints being deleted by retention: ".step-100.deleting-<hex>", renamed away before removal.
TRASH_PATTERN = re.compile(r"^\.(?P<final>.+)\.deleting-[0-9a-f]{12}$")


def trash_dir_for(path: Path) -> Path:
    """A fresh hidden name beside ``path`` to rename a checkpoint to before removing it."""
    return path.parent / f".{path.name}.deleting-{uuid.uuid4().hex[:12]}"


def is_trash_name(name: str) -> bool:
    """Whether ``name`` is a checkpoint that retention renamed away and had not finished removing."""
    return TRASH_PATTERN.match(name) is not None


def tmp_dir_for(final: Path) -> Path:
    """A fresh temporary directory name beside ``final`` (hidden, so listings and globs skip it)."""
    return final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:12]}"


def is_tmp_name(name: str) -> bool:
    """Whether ``name`` is the temporary directory of an unfinished (or crashed) save."""
    return TMP_PATTERN.match(name) is not None


# Note: who owns a temporary directory. The process that saves holds an exclusive ``flock`` on
# ``.step-N.tmp-<hex>.lock`` beside it from before the directory exists until the save ends; the
# kernel drops the lock however the process dies. A manager opening the directory removes a temp
# directory only when it can take that lock itself (its owner is gone) or the lock file is
# missing (the directory predates the lock), so a second process never removes a save in flight.
# Where ``fcntl`` is missing (Windows) nothing is locked and every temp directory counts as stale.
_HELD: dict[str, int] = {}


def _lock_path(tmp: Path) -> Path:
    return tmp.with_name(tmp.name + ".lock")


def lock_tmp(tmp: Path) -> None:
    """Create and hold the lock of the temporary directory ``tmp`` (call before creating ``tmp``)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        return
    fd = os.open(_lock_path(tmp), os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise
    _HELD[str(tmp)] = fd


def release_tmp(tmp: Path) -> None:
    """Drop the lock of ``tmp`` and remove its lock file (a no-op if this process holds none)."""
    fd = _HELD.pop(str(tmp), None)
    if fd is None:
        return
    try:
        _lock_path(tmp).unlink(missing_ok=True)
    finally:
        os.close(fd)


def tmp_in_use(tmp: Path) -> bool:
    """Whether a live process holds the lock of the temporary directory ``tmp`` (see the note above)."""
    if str(tmp) in _HELD:
        return True
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        return False
    try:
        fd = os.open(_lock_path(tmp), os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def is_tmp_lock_name(name: str) -> bool:
    """Whether ``name`` is the lock file of a save's temporary directory."""
    return name.endswith(".lock") and is_tmp_name(name[: -len(".lock")])


def fsync_file(path: Path) -> None:
    """Flush ``path``'s contents to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _load_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # a libc without it
        return None
    call.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    call.restype = ctypes.c_int
    return call


_SYNC_FILE_RANGE = _load_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of the range's dirty pages, do not wait for it


def start_writeback(fd: int, *, offset: int, length: int) -> bool:
    """Start writing ``length`` bytes of ``fd`` from ``offset`` to disk, without waiting; False where that cannot be.

    Note: why a save asks for this. A file written into the page cache stays there until its
    fsync, which then waits for the whole file at once: the disk idles while the file is written
    and the CPU idles while it is flushed. Starting each range's writeback as soon as it is
    written (Linux's ``sync_file_range(SYNC_FILE_RANGE_WRITE)``, the technique behind
    PostgreSQL's ``checkpoint_flush_after`` and RocksDB's ``bytes_per_sync``) overlaps the two,
    and the fsync at close -- still the only durability point -- finds most of the file on its
    way. It is a hint: nothing is promised until that fsync returns, and a platform or file
    system without it (False) changes only the timing.
    """
    if _SYNC_FILE_RANGE is None or length <= 0:
        return _SYNC_FILE_RANGE is not None
    if _SYNC_FILE_RANGE(fd, offset, length, _SYNC_FILE_RANGE_WRITE) == 0:
        return True
    # ESPIPE, EINVAL, ENOSYS: this file (system) cannot; EIO and the like: the fsync at close reports them.
    return ctypes.get_errno() not in (errno.ESPIPE, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EBADF)


# fsync on a directory descriptor is refused this way by some platforms and file systems: nothing to flush.
_FSYNC_UNSUPPORTED = (errno.EINVAL, errno.EBADF, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EISDIR)


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (new names, renames) to stable storage, where the platform allows it.

    Raises:
        OSError: the flush itself failed (``EIO``, ``ENOSPC``, ...): the entries may not be on disk, so
            the step that needed them durable must not be reported done. Platforms that cannot open or
            fsync a directory at all (Windows; ``EINVAL`` from some file systems) are not an error.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError as e:  # e.g. Windows cannot open directories; renames there are durable on return
        if e.errno in (errno.EACCES, errno.EISDIR, errno.EINVAL) or os.name == "nt":
            return
        raise
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in _FSYNC_UNSUPPORTED:
            raise
    finally:
        os.close(fd)


def write_unflushed(path: Path, data: bytes) -> int:
    """Create (or truncate) ``path`` and write ``data``; return the still open descriptor, for
    :func:`fsync_together` (``opened``) to flush and close, so the file is opened once, not again to flush it."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_BINARY", 0)
    fd = os.open(path, flags, 0o666)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except BaseException:
        os.close(fd)
        raise
    return fd


def _fsync_and_close(fd: int) -> None:
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_together(*, files: list[Path], directories: list[Path], opened: Sequence[int] = ()) -> None:
    """Flush several files' contents and directories' entries to stable storage at once.

    ``opened``: descriptors of files written here (:func:`write_unflushed`), flushed through them
    and closed, whatever happens (each such file costs one open in all, not a second one to flush it).

    Note: one journal commit instead of one each. A journaling file system (ext4, XFS) commits
    the fsyncs that wait at the same moment in one transaction, so small files fsynced from
    several threads at once cost about one commit, where fsyncing them one after another costs
    one commit each (about 4 ms apiece on this project's reference disk). Durability is the same:
    this returns only once every one of them is flushed.

    Raises:
        OSError: the first flush that failed (as :func:`fsync_file` and :func:`fsync_dir` raise).
    """
    jobs: list[Callable[[], None]] = [functools.partial(_fsync_and_close, fd) for fd in opened]
    jobs += [functools.partial(fsync_file, p) for p in files] + [functools.partial(fsync_dir, d) for d in directories]
    if len(jobs) <= 1:
        for job in jobs:
            job()
        return
    futures: list[Future[None]] = []
    try:
        pool = fsync_pool()
        for job in jobs:
            futures.append(pool.submit(job))
    finally:
        for fd in opened[len(futures) :]:  # not handed to a thread (the pool could not start it): closed here
            os.close(fd)
    for future in futures:
        future.result()


_FSYNC_THREADS = 16  # a save flushes a rank's data files (at most 8) and six commit paths at once
_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def fsync_pool() -> ThreadPoolExecutor:
    """The process's fsync threads (kept: starting a thread per path on every save costs more than the flush's CPU)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=_FSYNC_THREADS, thread_name_prefix="shardline-fsync")
        return _POOL


def _forget_pool() -> None:
    # A forked child has none of the parent's threads: it starts its own pool when it needs one.
    global _POOL, _POOL_LOCK
    _POOL, _POOL_LOCK = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)


def fsync_new_dirs(path: Path, *, existed: Path) -> None:
    """After ``path.mkdir(parents=True)``: fsync every directory from ``path`` up to ``existed`` (the deepest
    ancestor that existed before), so the new names survive a power loss."""
    path, existed = Path(path), Path(existed)
    current = path
    while True:
        fsync_dir(current)
        if current == existed or current.parent == current:
            break
        current = current.parent


def atomic_write_bytes(path: Path, data: bytes, *, crash_name: str | None = None) -> None:
    """Replace ``path`` with ``data`` atomically: write a temp file, fsync it, rename it over, fsync the dir.

    ``crash_name`` (``"latest"``, ``"head"``) names the :mod:`.crashpoints` of this write.
    """
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:12]}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if crash_name:
            crash_point(f"{crash_name}.tmp_written")
        os.replace(tmp, path)
        if crash_name:
            crash_point(f"{crash_name}.replaced")
    finally:
        if tmp.exists():
            tmp.unlink()
    fsync_dir(path.parent)
