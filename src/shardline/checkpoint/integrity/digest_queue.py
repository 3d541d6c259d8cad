"""SHA-256 of a file being written, computed behind the writer: in file order, on helper threads, finished at close.

Note: why hashing can trail the write, and when it may not.

A durable save spends a large part of its time in ``fsync``, waiting for the disk with the CPU
idle. If the digest had to be complete when each ``write`` returns, that idle time could not be
used: the writer thread would wait for the hash of every buffer before writing the next, and on
two cores two writer threads plus their hashing leave no core free. :class:`OrderedDigest` lets
``write`` return as soon as the bytes are in the file, queues the buffer, and hashes the queue in
order on the shared hasher pool; ``hexdigest`` (called once the file is closed, after its fsync)
waits for the queue.

When the queue is hashed depends on where the bytes go. A local file's writer threads are
usually as many as the cores a rank has (:mod:`.parallelism`), and copying into the page cache
keeps them busy, so hashing during the writes would only slow them down: the queue waits
(``eager=False``) until the stream's close starts the file's fsync, and is hashed while the disk
flushes. With fewer writers than cores (a small share, an explicit ``files_per_rank``) a
core is free during the writes too, and an upload waits on the network: those queues are hashed
as they grow (``eager=True``).

A queued buffer must still hold the bytes that were written when the hash reaches it. That is
certain for two kinds only, and only those are queued without a copy:

* a buffer of an immutable ``bytes`` object (``memoryview.obj``): the view keeps it alive;
* raw memory lying inside a tensor :class:`RetainedMemory` keeps alive: torch.save hands the
  stream the tensor's storage itself, and the writer retains every tensor it resolves until all
  its files are hashed (the tensors of a save do not change while it runs: a synchronous save
  blocks training, an async save writes a private staged copy).

Small buffers (headers, pickled records) are copied into the queue. Any other large buffer (a
mutable one, such as DCP's byte items; raw memory the writer does not retain, such as a tensor
DCP copied on its own off an accelerator) is hashed before ``write`` returns, overlapped with the
write itself.

A queue that is short when its hashing starts (a small file: ``.metadata``, a rank's file of a
small checkpoint's tail; at most :data:`_HERE_MAX` bytes) is hashed on the thread that starts it:
handing a few KiB to a helper thread and waiting for it at close costs more than their hash (on a
busy machine, the wait for the helper to be scheduled), and it sits on the save's critical path.
"""

from __future__ import annotations

import bisect
import hashlib
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np
import torch

__all__ = ["OrderedDigest", "RetainedMemory"]

_HERE_MAX = 64 << 10  # a queue this short when its hashing starts is hashed on the starting thread (module note)

T = TypeVar("T")


def _address(view: memoryview) -> int:
    """The address of a buffer's first byte (read-only buffers included)."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


class RetainedMemory:
    """Tensors kept alive for the duration of a write, and a test of whether a buffer lies inside one of them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Storages never overlap while alive, so their (start, end) ranges sorted by start answer a lookup
        # by bisection: a save writes one buffer per tensor, and a model may have thousands of them.
        self._ranges: list[tuple[int, int]] = []
        self._tensors: list[torch.Tensor] = []

    def keep(self, tensor: torch.Tensor) -> None:
        """Hold ``tensor`` (a CPU tensor that owns its whole storage) until :meth:`release`."""
        storage = tensor.untyped_storage()
        start = storage.data_ptr()
        with self._lock:
            self._tensors.append(tensor)
            bisect.insort(self._ranges, (start, start + storage.nbytes()))

    def covers(self, view: memoryview) -> bool:
        """True if every byte of ``view`` lies inside one retained tensor's storage."""
        if not view.nbytes:
            return False
        start = _address(view)
        end = start + view.nbytes
        with self._lock:
            at = bisect.bisect_right(self._ranges, (start, float("inf"))) - 1
            return at >= 0 and self._ranges[at][0] <= start and end <= self._ranges[at][1]

    def release(self) -> None:
        """Drop every retained tensor (after every file written with them is hashed)."""
        with self._lock:
            self._tensors.clear()
            self._ranges.clear()


class OrderedDigest:
    """A SHA-256 whose updates may run later, in order, on ``pool`` (see the module note).

    Only one drain task of a digest is on the pool at a time, so its updates stay in order
    without occupying more than one helper thread per file. With ``eager=False`` the queue is
    only hashed from :meth:`start` on (see the module note); :meth:`now` and :meth:`hexdigest`
    start it.
    """

    def __init__(self, pool: ThreadPoolExecutor, *, eager: bool = True) -> None:
        self._pool = pool
        self._started = eager
        self._hash = hashlib.sha256()
        self._cond = threading.Condition()
        self._queue: deque[bytes | memoryview] = deque()
        self._draining = False
        self._error: BaseException | None = None

    def _idle(self) -> bool:
        return not self._queue and not self._draining

    def later(self, buffer: bytes | memoryview) -> None:
        """Queue ``buffer`` (which must stay unchanged until :meth:`hexdigest` returns)."""
        with self._cond:
            self._queue.append(buffer)
        self._kick()

    def start(self) -> None:
        """Hash the queue from now on (a no-op once started): a short queue here and now, a longer one on the pool."""
        self._started = True
        if not self._hash_short_queue():
            self._kick()

    def _hash_short_queue(self) -> bool:
        with self._cond:
            if self._draining or not self._queue or len(self._queue) > 4:
                return False
            sizes = [b.nbytes if isinstance(b, memoryview) else len(b) for b in self._queue]
            if sum(sizes) > _HERE_MAX:
                return False
            self._draining = True  # no helper thread takes a buffer meanwhile: the updates stay in order
            buffers = list(self._queue)
            self._queue.clear()
        try:
            for buffer in buffers:
                self._hash.update(buffer)
        except BaseException as e:  # kept and raised by hexdigest, as a helper thread's error is
            with self._cond:
                self._error = e
                self._queue.clear()
        finally:
            with self._cond:
                self._draining = False
                self._cond.notify_all()
        self._kick()  # anything queued meanwhile (another thread's later()) goes to the pool as before
        return True

    def _kick(self) -> None:
        with self._cond:
            if not self._started or self._draining or not self._queue:
                return
            self._draining = True
        self._pool.submit(self._drain)

    def now(self, buffer: memoryview, write: Callable[[], T]) -> T:
        """Hash ``buffer`` before returning, overlapped with ``write()`` (which writes it); returns what it returns.

        For a buffer that may change once this returns. Updates queued before it are hashed first.
        """
        self.start()
        self.wait()
        if buffer.nbytes < (1 << 20):
            result = write()
            self._hash.update(buffer)
            return result
        pending = self._pool.submit(self._hash.update, buffer)
        try:
            return write()
        finally:
            pending.result()

    def _drain(self) -> None:
        while True:
            with self._cond:
                if not self._queue:
                    self._draining = False
                    self._cond.notify_all()
                    return
                buffer = self._queue.popleft()
            try:
                self._hash.update(buffer)
            except BaseException as e:  # kept, and raised by hexdigest in the writer's thread
                with self._cond:
                    self._error = e
                    self._queue.clear()
                    self._draining = False
                    self._cond.notify_all()
                return

    def wait(self) -> None:
        """Block until every queued update is done; raise the error a queued update raised."""
        with self._cond:
            self._cond.wait_for(self._idle)
            if self._error is not None:
                raise self._error

    def discard(self) -> None:
        """Drop what is still queued and wait for the update in progress (after a failed write).

        Afterwards no helper thread reads any buffer given to :meth:`later`, so the memory behind
        them may be released.
        """
        with self._cond:
            self._queue.clear()
            self._cond.wait_for(lambda: not self._draining)

    def hexdigest(self) -> str:
        """The digest of everything given so far (waits for the queue)."""
        self.start()
        self.wait()
        return self._hash.hexdigest()
