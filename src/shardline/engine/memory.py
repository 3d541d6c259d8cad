"""What the engine holds in memory, by component, now and at its peak.

Two kinds of components:

* **tracked** -- buffers the engine allocates and frees itself, counted at each allocation
  and release, with a high-water mark: gathered parameters (``unsharded_params``) and
  communication buffers (``comm_buffers``: all-gather outputs and casts, packed gradients and
  reduction outputs). Process-wide, like :func:`shardline.comm_stats`.
* **measured** -- tensors that live on the model and optimizer, summed when asked:
  ``sharded_params`` (flat shard buffers), ``sharded_grads``, ``unsharded_grads`` (full
  gradients not yet reduced, e.g. under ``no_sync``) and ``optimizer_state`` (when the
  optimizer is passed). Tensors sharing storage are counted once.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["MemoryStats", "memory_stats", "reset_peak_memory_stats"]

TRACKED = ("unsharded_params", "comm_buffers")


class _Tracker:
    def __init__(self) -> None:
        self._lock = threading.Lock()  # reductions finish on autograd threads on CUDA
        self.current = dict.fromkeys(TRACKED, 0)
        self.peak = dict.fromkeys(TRACKED, 0)

    def add(self, component: str, nbytes: int) -> None:
        with self._lock:
            value = self.current[component] + nbytes
            self.current[component] = value
            if value > self.peak[component]:
                self.peak[component] = value

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = dict(self.current)


TRACKER = _Tracker()


def nbytes(tensor: torch.Tensor) -> int:
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

    @property
    def total(self) -> int:
        """Everything held right now."""
        return (
            self.sharded_params
            + self.sharded_grads
            + self.optimizer_state
            + self.unsharded_params
            + self.unsharded_grads
            + self.comm_buffers
        )

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


def _storage_bytes(tensors: Any) -> int:
    seen: dict[tuple[int, int], int] = {}
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor) or t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key[0] == 0:  # empty storage: nothing held
            continue
        seen[key] = storage.nbytes()
    return sum(seen.values())


def memory_stats(model: nn.Module, *, optimizer: torch.optim.Optimizer | None = None) -> MemoryStats:
    """This rank's memory by component for ``model`` (and ``optimizer``'s state, if given)."""
    from shardline.engine.state import subtree_units  # state imports the units that import this module

    units = subtree_units(model)
    flat = [u.flat_shard for u in units]
    grads = [sp.sharded.grad for u in units for sp in u.params]
    full_grads = [
        t
        for u in units
        for sp in u.params
        for t in ((sp.unsharded.grad if sp.unsharded is not None else None), sp.accumulated_grad)
    ]
    state: list[torch.Tensor] = []
    if optimizer is not None:
        for per_param in optimizer.state.values():
            state.extend(v for v in per_param.values() if isinstance(v, torch.Tensor))
    return MemoryStats(
        sharded_params=_storage_bytes(flat),
        sharded_grads=_storage_bytes(grads),
        optimizer_state=_storage_bytes(state),
        unsharded_params=TRACKER.current["unsharded_params"],
        unsharded_grads=_storage_bytes(full_grads),
        comm_buffers=TRACKER.current["comm_buffers"],
        peak_unsharded_params=TRACKER.peak["unsharded_params"],
        peak_comm_buffers=TRACKER.peak["comm_buffers"],
    )


def reset_peak_memory_stats() -> None:
    """Start new high-water marks for the tracked components (at their current values)."""
    TRACKER.reset_peak()
