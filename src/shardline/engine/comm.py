"""Collectives with accounting.

Every collective shardline issues goes through this module, which records its kind, its
size and which unit and phase issued it. Two views exist:

* process-wide totals, always on and O(1) memory: :func:`comm_stats` / :func:`reset_comm_stats`;
* an itemized log while a :func:`count_collectives` block is active (tests and diagnostics).

``bytes`` is the logical size of the collective's full buffer: the gathered output of an
all-gather, the unreduced input of a reduce-scatter, the tensor of an all-reduce or broadcast,
and the full (all ranks) buffer of a scatter. ``wire_bytes`` is what one rank sends with the
bandwidth-optimal ring algorithms: ``(n-1)/n`` of that for all-gather, reduce-scatter and
scatter, ``2(n-1)/n`` for all-reduce, and ``(n-1)/n`` for broadcast (pipelined), where ``n`` is the
group size.
"""

from __future__ import annotations

import contextlib
import enum
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from shardline import _torch_compat

__all__ = [
    "CollectiveKind",
    "CollectiveRecord",
    "CommCounter",
    "CommStats",
    "comm_stats",
    "count_collectives",
    "delay_collectives",
    "reset_comm_stats",
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
    """Process-wide totals per collective kind since the last reset."""

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


class _DelayedWork:
    """Testing aid: an async collective whose result only appears, late, when waited on."""

    def __init__(self, work: Any, seconds: float, land: Any) -> None:
        self._work, self._seconds, self._land = work, seconds, land

    def wait(self, timeout: Any = None) -> bool:
        if self._work is not None:
            time.sleep(self._seconds)
            self._work.wait()
            self._land()
            self._work = None
        return True

    def is_completed(self) -> bool:
        return self._work is None


_delay: list[float] = []  # seconds; non-empty inside delay_collectives()
delayed_count = 0


@contextlib.contextmanager
def delay_collectives(seconds: float) -> Iterator[None]:
    """Testing aid: make every asynchronous collective look slow and land late.

    Inside the block an async collective writes into a scratch buffer while its real output
    holds NaN; the result is copied over only when the work is waited on, after ``seconds``.
    Code that reads a result before waiting for it -- a missing ``wait()`` or a wrong
    ordering between overlapped steps -- then computes with NaN, which a numerics test sees.
    """
    _delay.append(seconds)
    try:
        yield
    finally:
        _delay.pop()


def _maybe_delay(output: torch.Tensor, issue: Any) -> Any:
    """Issue an async collective through ``issue(target)``, delayed per :func:`delay_collectives`."""
    global delayed_count
    if not _delay:
        return issue(output)
    scratch = output.clone()
    work = issue(scratch)
    if output.is_floating_point():
        output.fill_(float("nan"))
    delayed_count += 1
    return _DelayedWork(work, _delay[-1], lambda: output.copy_(scratch))


_counts: dict[CollectiveKind, int] = {}
_bytes: dict[CollectiveKind, int] = {}
_wire: dict[CollectiveKind, int] = {}
_counters: list[CommCounter] = []


def comm_stats() -> CommStats:
    """Snapshot of this process's collective totals since start or the last :func:`reset_comm_stats`."""
    return CommStats(counts=dict(_counts), bytes=dict(_bytes), wire_bytes=dict(_wire))


def reset_comm_stats() -> None:
    """Zero the process-wide totals."""
    _counts.clear()
    _bytes.clear()
    _wire.clear()


@contextlib.contextmanager
def count_collectives() -> Iterator[CommCounter]:
    """Log every collective shardline issues inside the block.

    >>> with count_collectives() as counter:
    ...     loss.backward()
    >>> counter.count("reduce_scatter", phase="backward")
    """
    counter = CommCounter()
    _counters.append(counter)
    try:
        yield counter
    finally:
        _counters.remove(counter)


def _wire_factor(kind: CollectiveKind, n: int) -> float:
    if n <= 1:
        return 0.0
    if kind is CollectiveKind.ALL_REDUCE:
        return 2.0 * (n - 1) / n
    return (n - 1) / n


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _record(kind: CollectiveKind, nbytes: int, dtype: torch.dtype, group_size: int, unit: str, phase: str) -> None:
    wire = int(nbytes * _wire_factor(kind, group_size))
    _counts[kind] = _counts.get(kind, 0) + 1
    _bytes[kind] = _bytes.get(kind, 0) + nbytes
    _wire[kind] = _wire.get(kind, 0) + wire
    if _counters:
        record = CollectiveRecord(kind, nbytes, wire, dtype, group_size, unit, phase)
        for counter in _counters:
            counter.records.append(record)


def all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    unit: str = "",
    phase: str = "",
    async_op: bool = False,
) -> Any:
    """All-gather ``input`` into ``output`` (rank-major), recorded."""
    _record(CollectiveKind.ALL_GATHER, _nbytes(output), output.dtype, dist.get_world_size(group), unit, phase)
    if async_op:
        return _maybe_delay(output, lambda out: _torch_compat.all_gather_into(out, input, group, async_op=True))
    return _torch_compat.all_gather_into(output, input, group)


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    unit: str = "",
    phase: str = "",
    async_op: bool = False,
) -> Any:
    """Reduce-scatter ``input`` (rank-major) into ``output``, recorded."""
    _record(CollectiveKind.REDUCE_SCATTER, _nbytes(input), input.dtype, dist.get_world_size(group), unit, phase)
    if async_op:
        return _maybe_delay(
            output, lambda out: _torch_compat.reduce_scatter_into(out, input, group, op=op, async_op=True)
        )
    return _torch_compat.reduce_scatter_into(output, input, group, op=op)


def all_reduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    unit: str = "",
    phase: str = "",
    async_op: bool = False,
) -> Any:
    """All-reduce ``tensor`` in place, recorded."""
    _record(CollectiveKind.ALL_REDUCE, _nbytes(tensor), tensor.dtype, dist.get_world_size(group), unit, phase)
    if async_op:
        return _maybe_delay(tensor, lambda out: dist.all_reduce(out, op=op, group=group, async_op=True))
    return dist.all_reduce(tensor, op=op, group=group)


def broadcast(
    tensor: torch.Tensor, group: dist.ProcessGroup, *, src_rank: int = 0, unit: str = "", phase: str = ""
) -> None:
    """Broadcast ``tensor`` from the group's rank ``src_rank`` (a group-local rank), recorded."""
    _record(CollectiveKind.BROADCAST, _nbytes(tensor), tensor.dtype, dist.get_world_size(group), unit, phase)
    dist.broadcast(tensor, src=dist.get_global_rank(group, src_rank), group=group)


def scatter(
    output: torch.Tensor,
    chunks: list[torch.Tensor] | None,
    group: dist.ProcessGroup,
    *,
    src_rank: int = 0,
    unit: str = "",
    phase: str = "",
) -> None:
    """Scatter ``chunks`` (given on the source rank only) into ``output`` on every rank, recorded."""
    n = dist.get_world_size(group)
    _record(CollectiveKind.SCATTER, _nbytes(output) * n, output.dtype, n, unit, phase)
    dist.scatter(output, chunks, src=dist.get_global_rank(group, src_rank), group=group)
