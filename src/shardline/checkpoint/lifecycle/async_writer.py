"""The background thread an async :class:`~.manager.CheckpointManager` writes its checkpoints on.

A save stages its state into host buffers on the calling thread, then hands the write -- DCP,
the hashes, the commit -- to one background thread, so training goes on. The next save, a load,
``wait`` or ``close`` waits for it and raises its error, if any. Only one write runs at a time.

Note: a dedicated process group. The background thread's collectives (the write's gathers, the
commit's decisions) run on their own gloo group, created collectively when the manager is built,
so they can never interleave with training's collectives on the main group.

Note: a write still running when the interpreter exits. The thread is a daemon (it never holds up a
process that waited, or that fails), so without more it would be stopped where it stands once the
interpreter starts tearing down: the checkpoint never commits, and a thread stopped inside a torch call
(a collective, a file write) can end the process with "terminate called without an active exception"
(SIGABRT), since Python ends such a thread by unwinding it through C++ code that may not be unwound. So
the first write registers an exit hook: at exit, before the teardown, it says which save is still
writing and waits for it (its collectives are bounded by the group's timeout), then logs its error, if
any. ``wait()`` or ``close()`` before the end of a script is still the way to hear that error as an
exception.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from shardline import _torch_compat
from shardline.checkpoint.coordination import coord
from shardline.checkpoint.lifecycle.host_buffers import bind_writer_device
from shardline.errors import CheckpointError

__all__ = ["AsyncWriter"]

log = logging.getLogger(__name__)

_WRITERS: weakref.WeakSet[AsyncWriter] = weakref.WeakSet()  # every writer that started a write
_HOOK_LOCK = threading.Lock()
_hooked = False


def _finish_writes_at_exit() -> None:
    """The exit hook (see the module note): wait for every write still running, before the teardown."""
    for writer in list(_WRITERS):
        writer.finish_at_exit()


def _hook_exit() -> None:
    # Note: threading's exit hooks, not atexit's. The write hashes and fsyncs on thread pools
    # (concurrent.futures), which stop taking work in threading's own exit hook, before atexit's hooks run; the
    # wait must come before that. threading runs these hooks last-registered first, so this one (registered at
    # the first write, after the pools' hook) runs first. ``threading._register_atexit`` is what
    # concurrent.futures itself uses (Python >= 3.9); atexit is the fallback should it ever go.
    global _hooked
    with _HOOK_LOCK:
        if not _hooked:
            register = getattr(threading, "_register_atexit", atexit.register)
            register(_finish_writes_at_exit)
            _hooked = True


class AsyncWriter:
    """One background write at a time, on its own process group (see the module note).

    Args:
        process_group: The group of the ranks that save (default: the world).
        enabled: Whether writes go to the background at all; without, :attr:`group` is ``process_group``
            and :meth:`wait` has nothing to wait for.
    """

    def __init__(self, process_group: dist.ProcessGroup | None, *, enabled: bool) -> None:
        self.group = process_group
        """The group writes run their collectives on."""
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        if enabled and coord.group_size(process_group) > 1:
            timeout = _torch_compat.group_timeout(process_group)
            ranks = dist.get_process_group_ranks(process_group or dist.group.WORLD)
            kwargs: dict[str, Any] = {"timeout": timeout} if timeout is not None else {}
            self.group = dist.new_group(ranks=ranks, backend="gloo", **kwargs)

    def start(self, write: Callable[[], Any], *, name: str, device: torch.device | None) -> None:
        """Run ``write`` on a new background thread bound to ``device`` (a new thread starts on CUDA device 0); its
        error is kept for :meth:`wait`. The previous write must have been waited for."""

        def run() -> None:
            try:
                bind_writer_device(device)
                write()
            except BaseException as e:
                self._error = e

        self._thread = threading.Thread(target=run, name=name, daemon=True)
        _WRITERS.add(self)
        _hook_exit()
        self._thread.start()

    def wait(self) -> None:
        """Wait for the write in flight, if any; raise its error (a non-shardline one as a ``CheckpointError``)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, CheckpointError):
                raise error
            raise CheckpointError(f"the background checkpoint save failed: {type(error).__name__}: {error}") from error

    def finish_at_exit(self) -> None:
        """At interpreter exit: wait for a write nobody waited for, saying so; log its error (nothing raises)."""
        thread = self._thread
        if thread is None:
            return
        if thread.is_alive():
            log.warning(
                "the process is exiting while the async checkpoint save %r is still writing: waiting for it to "
                "finish (call CheckpointManager.close() before exiting to wait for it and hear its error)",
                thread.name,
            )
            thread.join()
        self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            log.error("the async checkpoint save %r failed: %s: %s", thread.name, type(error).__name__, error)
