"""Per-model views of what the engine communicates and holds: totals, itemized logs, memory by component.

Each sharded model keeps its own accounts in its root's context (:mod:`shardline.engine.context`);
these functions read them for the model (summing when a module holds several sharded trees).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from shardline.engine.comm import CollectiveKind, Collectives, Comm, CommCounter, CommStats
from shardline.engine.context import contexts_of
from shardline.engine.memory import MemoryStats
from shardline.engine.offload import TransferStats
from shardline.engine.registry import subtree_units

__all__ = [
    "comm_stats",
    "count_collectives",
    "memory_stats",
    "reset_comm_stats",
    "reset_peak_memory_stats",
    "transfer_stats",
    "use_collectives",
]


def _comms(model: nn.Module) -> list[Comm]:
    """The accounts of every tree of units under ``model`` (none for a model nothing sharded: it issues nothing)."""
    return [ctx.comm for ctx in contexts_of(model)]


def comm_stats(model: nn.Module) -> CommStats:
    """Totals of the collectives ``model``'s units issued since sharding or the last :func:`reset_comm_stats`.

    Sums over every root below ``model`` (usually exactly one: the model itself).
    """
    counts: dict[CollectiveKind, int] = {}
    nbytes: dict[CollectiveKind, int] = {}
    wire: dict[CollectiveKind, int] = {}
    for comm in _comms(model):
        stats = comm.stats()
        for mine, theirs in ((counts, stats.counts), (nbytes, stats.bytes), (wire, stats.wire_bytes)):
            for kind, value in theirs.items():
                mine[kind] = mine.get(kind, 0) + value
    return CommStats(counts=counts, bytes=nbytes, wire_bytes=wire)


def reset_comm_stats(model: nn.Module) -> None:
    """Zero ``model``'s collective totals."""
    for comm in _comms(model):
        comm.reset()


@contextlib.contextmanager
def count_collectives(*models: nn.Module) -> Iterator[CommCounter]:
    """Log every collective the given sharded models issue inside the block.

    >>> with count_collectives(model) as counter:
    ...     loss.backward()
    >>> counter.count("reduce_scatter", phase="backward")
    """
    counter = CommCounter()
    comms: list[Comm] = []
    for model in models:
        for comm in _comms(model):
            if all(comm is not c for c in comms):
                comms.append(comm)
    for comm in comms:
        comm.counters.append(counter)
    try:
        yield counter
    finally:
        for comm in comms:
            comm.counters[:] = [c for c in comm.counters if c is not counter]


@contextlib.contextmanager
def use_collectives(model: nn.Module, backend: Collectives) -> Iterator[None]:
    """Issue ``model``'s collectives through ``backend`` inside the block (accounting unchanged)."""
    comms = _comms(model)
    previous = [comm.backend for comm in comms]
    for comm in comms:
        comm.backend = backend
    try:
        yield
    finally:
        for comm, old in zip(comms, previous, strict=True):
            comm.backend = old


def _storage_bytes(tensors: Iterable[object]) -> int:
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
    units = subtree_units(model)
    trackers = [ctx.memory for ctx in contexts_of(model)]
    flat = [g.master for u in units for g in u.groups]
    grads = [sp.sharded.grad for u in units for sp in u.params] + [g.partial for u in units for g in u.groups]
    offloaded = [u for u in units if u.offload is not None]
    host_shards = {id(sp.sharded) for u in offloaded for sp in u.params}
    full_grads = [
        t
        for u in units
        for sp in u.params
        for t in ((sp.unsharded.grad if sp.unsharded is not None else None), sp.accumulated_grad)
    ]
    state: list[torch.Tensor] = []
    host_state: list[torch.Tensor] = []
    if optimizer is not None:
        for param, per_param in optimizer.state.items():
            tensors = [v for v in per_param.values() if isinstance(v, torch.Tensor)]
            state.extend(tensors)
            if id(param) in host_shards:
                host_state.extend(tensors)
    return MemoryStats(
        sharded_params=_storage_bytes(flat),
        sharded_grads=_storage_bytes(grads),
        optimizer_state=_storage_bytes(state),
        unsharded_params=sum(t.current["unsharded_params"] for t in trackers),
        unsharded_grads=_storage_bytes(full_grads),
        comm_buffers=sum(t.current["comm_buffers"] for t in trackers),
        peak_unsharded_params=sum(t.peak["unsharded_params"] for t in trackers),
        peak_comm_buffers=sum(t.peak["comm_buffers"] for t in trackers),
        host_params=_storage_bytes(g.master for u in offloaded for g in u.groups),
        host_grads=_storage_bytes(sp.sharded.grad for u in offloaded for sp in u.params),
        host_optimizer_state=_storage_bytes(host_state),
        quantized_params=_storage_bytes([u.quantized.local for u in units if u.quantized is not None]),
        host_quantized=_storage_bytes([u.quantized.local for u in offloaded if u.quantized is not None]),
    )


def transfer_stats(model: nn.Module) -> TransferStats:
    """Host <-> device copies ``model``'s offloaded units made since sharding (see :class:`~shardline.CPUOffload`)."""
    total = TransferStats()
    for unit in subtree_units(model):
        for group in unit.groups:
            if group.offload is not None:
                total.add(group.offload.stats)
        if unit.quantized is not None and unit.quantized.offload is not None:
            total.add(unit.quantized.offload.stats)
    return total


def reset_peak_memory_stats(model: nn.Module) -> None:
    """Start new high-water marks for ``model``'s tracked components (at their current values)."""
    for ctx in contexts_of(model):
        ctx.memory.reset_peak()
