"""One run per directory: an advisory lock file naming its holder (pid, host, start time, command).

``RUN_DIR/.shardline.lock`` is held with ``flock`` for as long as the run lasts -- by the
launching process, or by rank 0 under torchrun -- and holds one JSON line describing the
holder. A second run on the directory finds the lock taken and stops before any worker starts,
naming the holder. The kernel drops the lock when its holder dies however it dies, so a lock
file whose lock is free was left by a run that ended without cleaning up (``kill -9``, a
power loss): that is a *stale* lock; it is reported and taken over. Where the file system
cannot lock (some network mounts), the record decides: a live pid on this host holds the
directory, a dead one left a stale lock, and another host's record is refused (its pid cannot
be checked from here) with the way to clear it.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardline.errors import RunLockedError

__all__ = ["LOCK_NAME", "LockHolder", "RunLock"]

LOCK_NAME = ".shardline.lock"


@dataclass(frozen=True)
class LockHolder:
    """Who holds (or held) a run directory."""

    pid: int
    host: str
    started: str
    command: str

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}, started {self.started}"

    def is_alive_here(self) -> bool | None:
        """True/False for a pid on this host; None when the holder is on another host (cannot be checked)."""
        if self.host != socket.gethostname():
            return None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    @classmethod
    def current(cls) -> LockHolder:
        started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        return cls(os.getpid(), socket.gethostname(), started, " ".join(["shardline", *sys.argv[1:]])[:400])


def _read(fd: int) -> LockHolder | None:
    os.lseek(fd, 0, os.SEEK_SET)
    data = b""
    while chunk := os.read(fd, 4096):
        data += chunk
    try:
        record: Any = json.loads(data.decode("utf-8"))
        return LockHolder(int(record["pid"]), str(record["host"]), str(record["started"]), str(record["command"]))
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return None


class RunLock:
    """The lock of ``run_dir`` (see the module note). Use as a context manager, or :meth:`acquire`/:meth:`release`.

    Attributes:
        stale: After :meth:`acquire`, the holder a stale lock file named (None if there was none).
    """

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self.stale: LockHolder | None = None
        self._fd: int | None = None

    def _refuse(self, holder: LockHolder | None, why: str) -> RunLockedError:
        who = holder.describe() if holder else "a holder whose record is unreadable"
        return RunLockedError(
            f"run directory {self.run_dir} is in use by another run ({who}{why}; lock file {self.path}). Wait for it "
            "to finish, or choose another trainer.run_dir."
        )

    def acquire(self) -> RunLock:
        """Take the lock or raise :class:`~shardline.errors.RunLockedError` naming the holder.

        A stale lock is taken over and its holder left in :attr:`stale` for the caller to report.
        """
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                locked = self._lock(fd)
                previous = _read(fd)
                if not locked:
                    alive = previous.is_alive_here() if previous else None
                    if previous is not None and alive is not False:
                        why = "" if alive else "; this file system cannot lock, and that host cannot be checked"
                        raise self._refuse(previous, why)
                if os.fstat(fd).st_ino != os.stat(self.path).st_ino:  # replaced while we waited: try again
                    os.close(fd)
                    continue
            except BaseException:
                os.close(fd)
                raise
            self.stale = previous if previous is not None and previous.pid != os.getpid() else None
            record = json.dumps(LockHolder.current().__dict__).encode() + b"\n"
            os.ftruncate(fd, 0)
            os.pwrite(fd, record, 0)
            os.fsync(fd)
            self._fd = fd
            return self

    def _lock(self, fd: int) -> bool:
        """flock the file; True if locked, False if the file system cannot lock. Raises when someone holds it."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            raise self._refuse(_read(fd), "") from None
        except OSError as e:
            if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                return False
            raise

    def release(self) -> None:
        """Remove the lock file and drop the lock (idempotent)."""
        if self._fd is None:
            return
        try:
            if os.fstat(self._fd).st_ino == os.stat(self.path).st_ino:
                os.unlink(self.path)
        except OSError:
            pass
        finally:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
