"""Collectives with accounting, scoped to one sharded model.

Every collective a sharded model issues goes through the :class:`Comm` of its root (one per
tree of units: see :mod:`shardline.engine.context`), which records its kind, its size and which
unit and phase issued it. Two views exist (per model: :mod:`shardline.engine.accounting`):

* running totals, always on and O(1) memory: ``comm_stats`` / ``reset_comm_stats``;
* an itemized log while a ``count_collectives`` block is active (tests and diagnostics).

``bytes`` is the logical size of the collective's full buffer: the gathered output of an
all-gather, the unreduced input of a reduce-scatter, the tensor of an all-reduce or broadcast,
and the full (all ranks) buffer of a scatter. ``wire_bytes`` is what one rank sends with the
bandwidth-optimal ring algorithms: ``(n-1)/n`` of that for all-gather, reduce-scatter and
scatter, ``2(n-1)/n`` for all-reduce, and ``(n-1)/n`` for broadcast (pipelined), where ``n`` is the
group size.

Note: injecting communication behaviour. :class:`Comm` does the accounting and hands the
actual transfer to a :class:`Collectives` backend (:class:`TorchCollectives` by default).
Tests and fault drills swap the backend of one model (``use_collectives``) -- e.g.
``shardline.testing.DelayedCollectives``, whose asynchronous results land late -- so the
production path carries no test switches.

Note: all-gather and reduce-scatter on gloo. gloo's ring all-reduce is far better tuned than
its all-gather and reduce-scatter: on two CPU ranks, moving a 100 MB buffer took 0.10 s as an
all-reduce against 0.46 s as ``all_gather_into_tensor`` and 0.31 s as
``reduce_scatter_tensor`` (torch 2.13, gloo over loopback TCP on the benchmark machine). So
on gloo groups :class:`TorchCollectives` runs both as all-reduces of the full buffer, with
identical results:

* all-gather: every rank zeroes the others' slots of the output, copies its input into its own
  slot and bitwise-ORs the buffer (viewed as int32) across ranks -- each element is nonzero on
  exactly one rank, so the result is every rank's bits exactly (signed zeros and NaN payloads
  included);
* reduce-scatter: an all-reduce of the (scratch) input with the same op, then this rank's slice
  is copied to the output. gloo reduces each element over the ranks in the same order either
  way, so the values are bit-identical to its reduce-scatter's (checked in ``tests/test_comm.py``).

The bytes on the wire are those of an all-reduce (``2(n-1)/n`` of the buffer instead of
``(n-1)/n``), which :class:`Comm` records as ``wire_bytes``; ``bytes`` and the kind stay the
logical collective's. ``TorchCollectives(gloo_all_reduce=False)`` issues the native calls.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, cast

import torch
import torch.distributed as dist

from shardline import _torch_compat

if TYPE_CHECKING:
    from datetime import timedelta

__all__ = [
    "CollectiveKind",
    "CollectiveRecord",
    "Collectives",
    "Comm",
    "CommCounter",
    "CommStats",
    "TorchCollectives",
    "Work",
]


class CollectiveKind(str, enum.Enum):
    """The collectives shardline issues."""

    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"
    BROADCAST = "broadcast"
    SCATTER = "scatter"


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective as issued by this rank."""

    kind: CollectiveKind
    bytes: int
    wire_bytes: int
    dtype: torch.dtype
    group_size: int
    unit: str
    phase: str


@dataclass(frozen=True)
class CommStats:
    """Totals per collective kind since the last reset."""

    counts: dict[CollectiveKind, int]
    bytes: dict[CollectiveKind, int]
    wire_bytes: dict[CollectiveKind, int]

    def count(self, kind: CollectiveKind | str) -> int:
        """Number of collectives of ``kind``."""
        return self.counts.get(CollectiveKind(kind), 0)

    def nbytes(self, kind: CollectiveKind | str) -> int:
        """Logical bytes moved by collectives of ``kind``."""
        return self.bytes.get(CollectiveKind(kind), 0)

    @property
    def total_count(self) -> int:
        return sum(self.counts.values())

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())


@dataclass
class CommCounter:
    """Itemized log of the collectives issued while its :func:`count_collectives` block runs."""

    records: list[CollectiveRecord] = field(default_factory=list)

    def select(
        self, kind: CollectiveKind | str | None = None, *, unit: str | None = None, phase: str | None = None
    ) -> list[CollectiveRecord]:
        """Records matching every filter given."""
        want = CollectiveKind(kind) if kind is not None else None
        return [
            r
            for r in self.records
            if (want is None or r.kind is want)
            and (unit is None or r.unit == unit)
            and (phase is None or r.phase == phase)
        ]

    def count(
        self, kind: CollectiveKind | str | None = None, *, unit: str | None = None, phase: str | None = None
    ) -> int:
        """Number of collectives matching the filters."""
        return len(self.select(kind, unit=unit, phase=phase))

    def nbytes(
        self, kind: CollectiveKind | str | None = None, *, unit: str | None = None, phase: str | None = None
    ) -> int:
        """Logical bytes of the collectives matching the filters."""
        return sum(r.bytes for r in self.select(kind, unit=unit, phase=phase))


class Work(Protocol):
    """A collective in flight (``async_op=True``): torch's ``dist.Work``, or a backend's stand-in for one."""

    def wait(self) -> bool:
        """Block until the collective has landed."""


class Collectives(Protocol):
    """What shardline needs from a communication backend. Async calls return a work handle with ``wait()``.

    A backend may also offer ``gathers_in_place(group, *, numel, dtype, device) -> bool`` and
    ``all_gather_in_place(buffer, group, *, async_op)``: complete a buffer in which every rank
    wrote its own elements and zeroed the others (:class:`TorchCollectives` does, on gloo).
    """

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, *, async_op: bool
    ) -> Work | None:
        """All-gather ``input`` of every rank into ``output`` (rank-major)."""

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: dist.ProcessGroup,
        *,
        op: dist.ReduceOp.RedOpType,
        async_op: bool,
    ) -> Work | None:
        """Reduce ``input`` (rank-major) over the group; keep this rank's slice in ``output``.

        ``input`` is scratch: a backend may overwrite it.
        """

    def all_reduce(
        self, tensor: torch.Tensor, group: dist.ProcessGroup, *, op: dist.ReduceOp.RedOpType, async_op: bool
    ) -> Work | None:
        """Reduce ``tensor`` over the group, in place."""

    def broadcast(self, tensor: torch.Tensor, group: dist.ProcessGroup, *, src: int) -> None:
        """Broadcast ``tensor`` from global rank ``src``."""

    def scatter(
        self, output: torch.Tensor, chunks: list[torch.Tensor] | None, group: dist.ProcessGroup, *, src: int
    ) -> None:
        """Scatter ``chunks`` (given on global rank ``src``) into ``output`` on every rank."""


class _GathersInPlace(Protocol):
    """The optional part of a :class:`Collectives` backend (see its docstring)."""

    def all_gather_in_place(self, buffer: torch.Tensor, group: dist.ProcessGroup, *, async_op: bool) -> Work | None:
        """Complete ``buffer`` from the disjoint pieces every rank wrote into it."""


class _CopyAfter:
    """Work handle of an emulated reduce-scatter: waits for the all-reduce, then copies this rank's slice out."""

    def __init__(self, work: Work | None, output: torch.Tensor, source: torch.Tensor) -> None:
        self._work, self._output, self._source = work, output, source

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self._work is not None:
            self._work.wait()
            self._output.copy_(self._source)
            self._work = None
        return True

    def is_completed(self) -> bool:
        return self._work is None


@functools.cache
def _is_gloo(group: dist.ProcessGroup) -> bool:
    return str(dist.get_backend(group)) == "gloo"


class TorchCollectives:
    """The default backend: ``torch.distributed``; on gloo, all-gather and reduce-scatter run as all-reduces.

    Args:
        gloo_all_reduce: Run all-gathers and reduce-scatters of CPU tensors on gloo groups as
            all-reduces (see the note at the top of this module). False: always the native calls.
    """

    def __init__(self, *, gloo_all_reduce: bool = True) -> None:
        self.gloo_all_reduce = gloo_all_reduce

    def _via_all_reduce(self, tensor: torch.Tensor, group: dist.ProcessGroup) -> bool:
        return self.gloo_all_reduce and tensor.device.type == "cpu" and tensor.is_contiguous() and _is_gloo(group)

    def transport(self, kind: CollectiveKind, tensor: torch.Tensor, group: dist.ProcessGroup) -> CollectiveKind:
        """The collective that actually moves ``tensor`` for a ``kind`` collective (for wire-byte accounting)."""
        if kind is CollectiveKind.ALL_GATHER and self._gathers_via_all_reduce(tensor, group):
            return CollectiveKind.ALL_REDUCE
        if kind is CollectiveKind.REDUCE_SCATTER and self._via_all_reduce(tensor, group):
            return CollectiveKind.ALL_REDUCE
        return kind

    def _gathers_via_all_reduce(self, output: torch.Tensor, group: dist.ProcessGroup) -> bool:
        return self._via_all_reduce(output, group) and (output.numel() * output.element_size()) % 4 == 0

    def gathers_in_place(
        self, group: dist.ProcessGroup, *, numel: int, dtype: torch.dtype, device: torch.device
    ) -> bool:
        """Whether :meth:`all_gather_in_place` works for such a buffer (CPU tensors on gloo, whole int32 words)."""
        if not self.gloo_all_reduce or device.type != "cpu" or not _is_gloo(group):
            return False
        return (numel * torch.empty((), dtype=dtype).element_size()) % 4 == 0

    def all_gather_in_place(self, buffer: torch.Tensor, group: dist.ProcessGroup, *, async_op: bool) -> Work | None:
        """Every rank filled its own elements of ``buffer`` and zeroed the rest: OR the bits across ranks."""
        work: Work | None = dist.all_reduce(
            buffer.view(torch.int32), op=dist.ReduceOp.BOR, group=group, async_op=async_op
        )
        return work

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, *, async_op: bool
    ) -> Work | None:
        if not self._gathers_via_all_reduce(output, group):
            return _torch_compat.all_gather_into(output, input, group, async_op=async_op)
        slots = output.view(dist.get_world_size(group), -1)
        rank = dist.get_rank(group)
        slots[:rank].zero_()
        slots[rank].copy_(input.view(-1))
        slots[rank + 1 :].zero_()
        work: Work | None = dist.all_reduce(
            output.view(torch.int32), op=dist.ReduceOp.BOR, group=group, async_op=async_op
        )
        return work

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: dist.ProcessGroup,
        *,
        op: dist.ReduceOp.RedOpType,
        async_op: bool,
    ) -> Work | None:
        if not self._via_all_reduce(input, group):
            return _torch_compat.reduce_scatter_into(output, input, group, op=op, async_op=async_op)
        work: Work | None = dist.all_reduce(input, op=op, group=group, async_op=async_op)
        mine = input.view(dist.get_world_size(group), -1)[dist.get_rank(group)]
        if not async_op:
            output.copy_(mine.view_as(output))
            return None
        return _CopyAfter(work, output, mine.view_as(output))

    def all_reduce(
        self, tensor: torch.Tensor, group: dist.ProcessGroup, *, op: dist.ReduceOp.RedOpType, async_op: bool
    ) -> Work | None:
        work: Work | None = dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
        return work

    def broadcast(self, tensor: torch.Tensor, group: dist.ProcessGroup, *, src: int) -> None:
        dist.broadcast(tensor, src=src, group=group)

    def scatter(
        self, output: torch.Tensor, chunks: list[torch.Tensor] | None, group: dist.ProcessGroup, *, src: int
    ) -> None:
        dist.scatter(output, chunks, src=src, group=group)


def _wire_factor(kind: CollectiveKind, n: int) -> float:
    if n <= 1:
        return 0.0
    if kind is CollectiveKind.ALL_REDUCE:
        return 2.0 * (n - 1) / n
    return (n - 1) / n


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class Comm:
    """Issues one model's collectives through a :class:`Collectives` backend and accounts for them."""

    def __init__(self, backend: Collectives | None = None) -> None:
        self.backend: Collectives = backend or TorchCollectives()
        self._counts: dict[CollectiveKind, int] = {}
        self._bytes: dict[CollectiveKind, int] = {}
        self._wire: dict[CollectiveKind, int] = {}
        self.counters: list[CommCounter] = []

    # ------------------------------------------------------------------ accounting
    def stats(self) -> CommStats:
        """Snapshot of the totals since creation or the last :meth:`reset`."""
        return CommStats(counts=dict(self._counts), bytes=dict(self._bytes), wire_bytes=dict(self._wire))

    def reset(self) -> None:
        """Zero the totals."""
        self._counts.clear()
        self._bytes.clear()
        self._wire.clear()

    def absorb(self, other: Comm) -> None:
        """Add ``other``'s totals and open counters to this one (a parent root took over its units)."""
        for mine, theirs in ((self._counts, other._counts), (self._bytes, other._bytes), (self._wire, other._wire)):
            for kind, value in theirs.items():
                mine[kind] = mine.get(kind, 0) + value
        for counter in other.counters:
            if all(counter is not c for c in self.counters):
                self.counters.append(counter)

    def _record(
        self,
        kind: CollectiveKind,
        tensor: torch.Tensor,
        nbytes: int,
        group: dist.ProcessGroup,
        unit: str,
        phase: str,
    ) -> None:
        group_size = dist.get_world_size(group)
        transport = getattr(self.backend, "transport", None)
        moved = transport(kind, tensor, group) if transport is not None else kind
        wire = int(nbytes * _wire_factor(moved, group_size))
        dtype = tensor.dtype
        self._counts[kind] = self._counts.get(kind, 0) + 1
        self._bytes[kind] = self._bytes.get(kind, 0) + nbytes
        self._wire[kind] = self._wire.get(kind, 0) + wire
        if self.counters:
            record = CollectiveRecord(kind, nbytes, wire, dtype, group_size, unit, phase)
            for counter in self.counters:
                counter.records.append(record)

    # ------------------------------------------------------------------ collectives
    def all_gather(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: dist.ProcessGroup,
        *,
        unit: str = "",
        phase: str = "",
        async_op: bool = False,
    ) -> Work | None:
        """All-gather ``input`` into ``output`` (rank-major), recorded."""
        self._record(CollectiveKind.ALL_GATHER, output, _nbytes(output), group, unit, phase)
        return self.backend.all_gather(output, input, group, async_op=async_op)

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: dist.ProcessGroup,
        *,
        op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
        unit: str = "",
        phase: str = "",
        async_op: bool = False,
    ) -> Work | None:
        """Reduce-scatter ``input`` (rank-major) into ``output``, recorded."""
        self._record(CollectiveKind.REDUCE_SCATTER, input, _nbytes(input), group, unit, phase)
        return self.backend.reduce_scatter(output, input, group, op=op, async_op=async_op)

    def can_gather_in_place(
        self, group: dist.ProcessGroup, *, numel: int, dtype: torch.dtype, device: torch.device
    ) -> bool:
        """Whether the backend can gather disjoint pieces of a buffer in place (see :meth:`all_gather_in_place`)."""
        check = getattr(self.backend, "gathers_in_place", None)
        return bool(check is not None and check(group, numel=numel, dtype=dtype, device=device))

    def all_gather_in_place(
        self,
        buffer: torch.Tensor,
        group: dist.ProcessGroup,
        *,
        nbytes: int,
        unit: str = "",
        phase: str = "",
        async_op: bool = False,
    ) -> Work | None:
        """Complete ``buffer`` on every rank from the disjoint pieces each rank wrote into it (zeros elsewhere).

        Recorded as the all-gather it stands for, of ``nbytes`` logical bytes. Only for backends
        whose ``gathers_in_place`` says so.
        """
        self._record(CollectiveKind.ALL_GATHER, buffer, nbytes, group, unit, phase)
        backend = cast(_GathersInPlace, self.backend)  # callers asked can_gather_in_place first
        return backend.all_gather_in_place(buffer, group, async_op=async_op)

    def all_reduce(
        self,
        tensor: torch.Tensor,
        group: dist.ProcessGroup,
        *,
        op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
        unit: str = "",
        phase: str = "",
        async_op: bool = False,
    ) -> Work | None:
        """All-reduce ``tensor`` in place, recorded."""
        self._record(CollectiveKind.ALL_REDUCE, tensor, _nbytes(tensor), group, unit, phase)
        return self.backend.all_reduce(tensor, group, op=op, async_op=async_op)

    def broadcast(
        self, tensor: torch.Tensor, group: dist.ProcessGroup, *, src_rank: int = 0, unit: str = "", phase: str = ""
    ) -> None:
        """Broadcast ``tensor`` from the group's rank ``src_rank`` (a group-local rank), recorded."""
        self._record(CollectiveKind.BROADCAST, tensor, _nbytes(tensor), group, unit, phase)
        self.backend.broadcast(tensor, group, src=dist.get_global_rank(group, src_rank))

    def scatter(
        self,
        output: torch.Tensor,
        chunks: list[torch.Tensor] | None,
        group: dist.ProcessGroup,
        *,
        src_rank: int = 0,
        unit: str = "",
        phase: str = "",
    ) -> None:
        """Scatter ``chunks`` (given on the source rank only) into ``output`` on every rank, recorded."""
        self._record(CollectiveKind.SCATTER, output, _nbytes(output) * dist.get_world_size(group), group, unit, phase)
        self.backend.scatter(output, chunks, group, src=dist.get_global_rank(group, src_rank))
