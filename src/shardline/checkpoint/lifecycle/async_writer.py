"""The background thread an async :class:`~.manager.CheckpointManager` writes its checkpoints on.

A save stages its state into host buffers on the calling thread, then hands the write -- DCP,
the hashes, the commit -- to one background thread, so training goes on. The next save, a load,
``wait`` or ``close`` waits for it and raises its error, if any. Only one write runs at a time.

Note: a dedicated process group. The background thread's collectives (the write's gathers, the
commit's decisions) run on their own gloo group, created collectively when the manager is built,
so they can never interleave with training's collectives on the main group.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from shardline import _torch_compat
from shardline.checkpoint.coordination import coord
from shardline.checkpoint.lifecycle.host_buffers import bind_writer_device
from shardline.errors import CheckpointError

__all__ = ["AsyncWriter"]


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
