"""A file's early-writeback hints, issued on the fsync threads instead of the thread that writes the file.

Note: why the hints leave the writer thread. ``sync_file_range(SYNC_FILE_RANGE_WRITE)``
(:func:`~.fsutil.start_writeback`) is meant to return at once, but it queues the range's pages
for the disk, and when the disk's queue is full it waits for room: under load a call every
4 MiB blocked the writing thread for milliseconds each time, during which that thread copied
nothing into the page cache. :class:`BackgroundWriteback` takes each range from the writer,
merges it with any range still waiting, and asks for it on the process's fsync threads
(:func:`~.fsutil.fsync_pool`), one call at a time per file and in file order, through its own
duplicate of the file's descriptor. The writer never waits for a hint while it writes.

Durability does not depend on the hints: the file's fsync is still the only durability point.
:meth:`BackgroundWriteback.close`, called before that fsync, drops the ranges not yet asked for
(the fsync writes them anyway), so no new hint is issued once the file's flush has begun. It does
not wait for the one call in progress, if any: on a busy disk that call can wait milliseconds for
room in the queue, which held the writer (and the save) at every file's close. The fsync may run
beside it -- it writes and waits for every dirty page of the file, those the hint started
included -- and the hint's own descriptor is closed by whichever of the two ends last.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from shardline.checkpoint.storage.fsutil import fsync_pool, start_writeback

__all__ = ["BackgroundWriteback"]


class BackgroundWriteback:
    """Writeback hints for one open file, asked for in order off the caller's thread (see the module note).

    Args:
        fd: The file's descriptor (duplicated here: the caller may close its own first).
        start: The hint itself (default :func:`~.fsutil.start_writeback`): ``start(fd, offset=, length=)``,
            False where the file cannot be flushed early.
        pool: Where the hints run (default: the process's fsync threads).
    """

    def __init__(
        self,
        fd: int,
        *,
        start: Callable[..., bool] = start_writeback,
        pool: ThreadPoolExecutor | None = None,
    ) -> None:
        self._fd = os.dup(fd)
        self._start = start
        self._pool = pool  # None: the process's fsync threads, looked up at each hint (a forked child has its own)
        self._cond = threading.Condition()
        self._pending: tuple[int, int] | None = None  # (start, end) of the bytes not yet asked for
        self._running = False
        self._closed = False
        self._supported = True
        self.calls = 0  # hints asked for so far

    def request(self, *, offset: int, length: int) -> bool:
        """Ask for ``length`` bytes from ``offset`` to be written back soon; returns at once.

        Returns False once a hint has found that this file cannot be flushed early (then no more are asked for),
        or once the queue is closed.
        """
        with self._cond:
            if self._closed or not self._supported:
                return self._supported and not self._closed
            start = offset if self._pending is None else self._pending[0]
            self._pending = (start, offset + length)
            if self._running:
                return True  # the call in progress takes the merged range next
            self._running = True
        try:
            (self._pool or fsync_pool()).submit(self._drain)
        except RuntimeError:  # the pool is shut down (interpreter exit): the fsync at close does the work
            with self._cond:
                self._running = False
                self._pending = None
                self._cond.notify_all()
        return True

    def _drain(self) -> None:
        while True:
            with self._cond:
                if self._pending is None or self._closed:
                    self._running = False
                    self._cond.notify_all()
                    closed = self._closed
                    break
                (start, end), self._pending = self._pending, None
            try:
                supported = bool(self._start(self._fd, offset=start, length=end - start))
            except BaseException:  # a hint only: the fsync at close reports any real error of the file
                supported = False
            with self._cond:
                self.calls += 1
                if not supported:
                    self._supported = False
                    self._pending = None
        if closed:  # closed while this call ran: the descriptor is this thread's to release
            os.close(self._fd)

    def close(self) -> None:
        """Drop the ranges not yet asked for and release the descriptor, now or when the call in progress ends
        (without waiting for it: see the module note)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._pending = None
            if self._running:
                return  # the draining thread releases the descriptor once its call returns
        os.close(self._fd)
