"""Where an async save stages: reusable host buffers, one copy of the state, none on the model's device.

Note: why. An async save must copy the state before training mutates it in place. Copying on
the model's device (``clone()`` of each shard) holds a second copy of params and optimizer state
in GPU memory until the write ends, and the bytes then cross to the host twice more (once to
hash them, once in DCP). Instead every tensor is copied once, on the calling thread, into a host
tensor of its shape and dtype -- page-locked ("pinned") when the source is on CUDA, so the copy
is a DMA at full speed -- the digest is taken from those host bytes and DCP writes them. Peak
extra device memory of an async save: zero.

Note: reuse. The buffers belong to a :class:`HostBuffers` that the manager keeps for its life.
Each staging round (:meth:`HostBuffers.begin`) takes the buffers the previous round lent back:
the caller guarantees that round's write has ended (``CheckpointManager.save`` waits for it
first). Buffers are matched by (shape, dtype, pinned) in the order they were lent, so a model
whose state keeps its shapes gets the same buffers, tensor for tensor, save after save, and
allocates (and pins, which is slow) only on its first save. :meth:`HostBuffers.finish` frees
buffers a round did not use, so the pool holds one copy of the newest state and no more.

Note: the copy from a CUDA tensor into pinned memory is issued blocking. A non-blocking copy would
need an event per tensor before its bytes may be hashed; the blocking one makes each buffer final
when :meth:`HostBuffers.copy` returns, so the SHA-256 helper threads hash it while the next
tensor is copied (:mod:`.copy_check`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["HostBuffers", "bind_writer_device", "host_buffer_like", "pins_for"]

_Key = tuple[tuple[int, ...], torch.dtype, bool]


def pins_for(device: object) -> bool:
    """Whether the host copy of a tensor on ``device`` is pinned: only for CUDA (pinning needs a CUDA runtime)."""
    return getattr(device, "type", None) == "cuda"


def host_buffer_like(source: torch.Tensor) -> torch.Tensor:
    """An uninitialized contiguous CPU tensor of ``source``'s shape and dtype, pinned when ``source`` is on CUDA."""
    return torch.empty(tuple(source.shape), dtype=source.dtype, device="cpu", pin_memory=pins_for(source.device))


def bind_writer_device(
    device: Any,
    *,
    set_device: Callable[[Any], None] = torch.cuda.set_device,
) -> bool:
    """Make ``device`` the current CUDA device of the calling (writer) thread; a no-op unless it is a CUDA device.

    A new thread's current CUDA device is device 0 whatever its parent's was, so the background
    writer of local rank 1 would otherwise create a context and sync streams on device 0.
    Returns whether a device was set.
    """
    if not pins_for(device):
        return False
    set_device(device)
    return True


class HostBuffers:
    """Host tensors an async save stages into, reused across saves (see the module notes)."""

    def __init__(self) -> None:
        self._free: dict[_Key, deque[torch.Tensor]] = {}
        self._lent: list[tuple[_Key, torch.Tensor]] = []
        self.source_device: torch.device | None = None
        """The first non-CPU device copied from this round (the writer thread binds to it), or None."""

    @staticmethod
    def _key(tensor: torch.Tensor, *, pinned: bool) -> _Key:
        return tuple(tensor.shape), tensor.dtype, pinned

    def begin(self) -> None:
        """Start a staging round: the buffers lent by the last one may be handed out again (its write has ended)."""
        for key, buffer in self._lent:
            self._free.setdefault(key, deque()).append(buffer)
        self._lent = []
        self.source_device = None

    def copy(self, source: torch.Tensor) -> torch.Tensor:
        """A host copy of ``source`` in a buffer of this pool, complete when this returns."""
        source = source.detach()
        key = self._key(source, pinned=pins_for(source.device))
        free = self._free.get(key)
        buffer = free.popleft() if free else host_buffer_like(source)
        buffer.copy_(source)
        self._lent.append((key, buffer))
        if self.source_device is None and source.device.type != "cpu":
            self.source_device = source.device
        return buffer

    def finish(self) -> None:
        """End a staging round: free the buffers it did not use."""
        self._free.clear()

    def clear(self) -> None:
        """Free every buffer (the manager closes; no write is in flight)."""
        self._free.clear()
        self._lent = []
        self.source_device = None

    @property
    def buffers(self) -> tuple[torch.Tensor, ...]:
        """The buffers the current (or last) round handed out, in order."""
        return tuple(buffer for _, buffer in self._lent)

    @property
    def nbytes(self) -> int:
        """Bytes of host memory the pool holds."""
        held = [*self.buffers, *(b for free in self._free.values() for b in free)]
        return sum(b.untyped_storage().nbytes() for b in held)
