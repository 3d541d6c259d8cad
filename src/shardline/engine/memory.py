"""What the engine holds in memory, by component, now and at its peak.

Two kinds of components:

* **tracked** -- buffers the engine allocates and frees itself, counted at each allocation
  and release, with a high-water mark: gathered parameters (``unsharded_params``, including
  the pieces a partial reshard keeps after forward) and
  communication buffers (``comm_buffers``: all-gather outputs and casts, packed gradients and
  reduction outputs). Tracked per sharded model (its root's :class:`MemoryTracker`).
* **measured** -- tensors that live on the model and optimizer, summed when asked:
  ``sharded_params`` (the master buffers: flat shards, or the full parameters SHARD_OPT keeps),
  ``sharded_grads`` (reduced gradients -- SHARD_OPT's are views of the full all-reduced
  gradients, so those count whole -- and partial sums awaiting a deferred all-reduce across
  replicas), ``unsharded_grads`` (full gradients not yet reduced, e.g. under ``no_sync``) and
  ``optimizer_state`` (when the optimizer is passed), and ``quantized_params``: this rank's
  blocks of the frozen 4-bit (NF4) weights, kept apart from the flat buffers
  (:mod:`shardline.engine.quantized`); their gathered copies count in ``unsharded_params``.
  Tensors sharing storage are counted once.

Where they live: with CPU offload (:mod:`shardline.engine.offload`) a unit's sharded parameters,
gradients and optimizer state are in host memory, and so are its 4-bit blocks; ``host_params``,
``host_grads``, ``host_optimizer_state`` and ``host_quantized`` say how many bytes of the four
measured components ``sharded_params``, ``sharded_grads``, ``optimizer_state`` and
``quantized_params`` those are (each ``host_*`` a part of its own component), and
:attr:`MemoryStats.device_total` what is left on the device (tracked components, including the
gathered unit and the staging copies of offloaded shards, are always on the device).
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass

import torch

__all__ = ["TRACKED", "MemoryStats", "MemoryTracker", "nbytes"]

TRACKED = ("unsharded_params", "comm_buffers")


class MemoryTracker:
    """Bytes of the engine's own buffers for one sharded model, with high-water marks.

    Note: the spare buffer. Packing a unit's gradients needs a scratch buffer the size of the
    unit's gradients, and the next unit (usually the same size) needs one again right after. A
    freshly allocated CPU buffer that large costs its page faults on every first touch (~5x the
    time of writing warm memory), so the tracker keeps the last scratch buffer given back
    (:meth:`give`) and hands it out again when the size matches (:meth:`take`). It stays counted
    in ``comm_buffers`` while kept; the end of each backward pass drops it (:meth:`drop_spare`),
    so nothing is held between steps.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()  # reductions may finish on autograd threads
        self.current = dict.fromkeys(TRACKED, 0)
        self.peak = dict.fromkeys(TRACKED, 0)
        self._spare: torch.Tensor | None = None

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1-D scratch buffer (uninitialized): the spare one if it matches, else a new one (counted)."""
        with self._lock:
            spare, self._spare = self._spare, None
        if spare is not None and spare.numel() == numel and spare.dtype == dtype and spare.device == device:
            return spare
        if spare is not None:
            self.add("comm_buffers", -nbytes(spare))
            del spare
        buffer = torch.empty(numel, dtype=dtype, device=device)
        self.add("comm_buffers", nbytes(buffer))
        return buffer

    def give(self, buffer: torch.Tensor) -> None:
        """Keep ``buffer`` (from :meth:`take`) as the spare; it stays counted until reused or dropped."""
        with self._lock:
            old, self._spare = self._spare, buffer.view(-1)
        if old is not None:
            self.add("comm_buffers", -nbytes(old))

    def drop_spare(self) -> None:
        """Free the spare buffer."""
        with self._lock:
            old, self._spare = self._spare, None
        if old is not None:
            self.add("comm_buffers", -nbytes(old))

    def add(self, component: str, nbytes: int) -> None:
        """Count ``nbytes`` more (negative: fewer) of ``component``."""
        with self._lock:
            value = self.current[component] + nbytes
            self.current[component] = value
            if value > self.peak[component]:
                self.peak[component] = value

    def reset_peak(self) -> None:
        """Start new high-water marks at the current values."""
        with self._lock:
            self.peak = dict(self.current)

    def absorb(self, other: MemoryTracker) -> None:
        """Take over ``other``'s live buffers (a parent root took over its units)."""
        for component in TRACKED:
            self.add(component, other.current[component])


def nbytes(tensor: torch.Tensor) -> int:
    """Bytes of ``tensor``'s elements."""
    return tensor.numel() * tensor.element_size()


@dataclass(frozen=True)
class MemoryStats:
    """Bytes per component on this rank (see the module docstring for what each one covers)."""

    sharded_params: int
    sharded_grads: int
    optimizer_state: int
    unsharded_params: int
    unsharded_grads: int
    comm_buffers: int
    peak_unsharded_params: int
    peak_comm_buffers: int
    host_params: int = 0
    host_grads: int = 0
    host_optimizer_state: int = 0
    quantized_params: int = 0
    host_quantized: int = 0

    @property
    def total(self) -> int:
        """Everything held right now."""
        return (
            self.sharded_params
            + self.quantized_params
            + self.sharded_grads
            + self.optimizer_state
            + self.unsharded_params
            + self.unsharded_grads
            + self.comm_buffers
        )

    @property
    def host_total(self) -> int:
        """What offloaded units hold in host memory (parameters, 4-bit blocks, gradients, optimizer state)."""
        return self.host_params + self.host_quantized + self.host_grads + self.host_optimizer_state

    @property
    def device_total(self) -> int:
        """Everything held right now on the compute device: :attr:`total` less :attr:`host_total`."""
        return self.total - self.host_total

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total, "host_total": self.host_total, "device_total": self.device_total}
