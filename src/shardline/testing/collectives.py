"""Communication backends for tests and fault drills, injected with ``shardline.engine.use_collectives``."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from datetime import timedelta
from typing import cast

import torch
import torch.distributed as dist

from shardline.engine import Collectives, TorchCollectives, Work

__all__ = ["DelayedCollectives", "FaultyCollectives", "GradientFault"]


class _Forwarding:
    """Every collective passed through to ``inner``: the base the test backends override a few of."""

    def __init__(self, inner: Collectives | None = None) -> None:
        self.inner: Collectives = inner or TorchCollectives()

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, *, async_op: bool
    ) -> Work | None:
        return self.inner.all_gather(output, input, group, async_op=async_op)

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: dist.ProcessGroup,
        *,
        op: dist.ReduceOp.RedOpType,
        async_op: bool,
    ) -> Work | None:
        return self.inner.reduce_scatter(output, input, group, op=op, async_op=async_op)

    def all_reduce(
        self, tensor: torch.Tensor, group: dist.ProcessGroup, *, op: dist.ReduceOp.RedOpType, async_op: bool
    ) -> Work | None:
        return self.inner.all_reduce(tensor, group, op=op, async_op=async_op)

    def gathers_in_place(
        self, group: dist.ProcessGroup, *, numel: int, dtype: torch.dtype, device: torch.device
    ) -> bool:
        check = getattr(self.inner, "gathers_in_place", None)
        return bool(check is not None and check(group, numel=numel, dtype=dtype, device=device))

    def all_gather_in_place(self, buffer: torch.Tensor, group: dist.ProcessGroup, *, async_op: bool) -> Work | None:
        return _in_place(self.inner)(buffer, group, async_op=async_op)

    def broadcast(self, tensor: torch.Tensor, group: dist.ProcessGroup, *, src: int) -> None:
        self.inner.broadcast(tensor, group, src=src)

    def scatter(
        self, output: torch.Tensor, chunks: list[torch.Tensor] | None, group: dist.ProcessGroup, *, src: int
    ) -> None:
        self.inner.scatter(output, chunks, group, src=src)


_GatherInPlace = Callable[..., Work | None]


def _in_place(backend: Collectives) -> _GatherInPlace:
    """``backend``'s optional ``all_gather_in_place`` (the engine calls it only where ``gathers_in_place`` said so)."""
    return cast(_GatherInPlace, backend.all_gather_in_place)  # type: ignore[attr-defined]


class _DelayedWork:
    """An async collective whose result only appears, late, when waited on."""

    def __init__(self, work: Work | None, seconds: float, land: Callable[[], object]) -> None:
        self._work, self._seconds, self._land = work, seconds, land

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self._work is not None:
            time.sleep(self._seconds)
            self._work.wait()
            self._land()
            self._work = None
        return True

    def is_completed(self) -> bool:
        return self._work is None


class DelayedCollectives(_Forwarding):
    """Make every asynchronous collective look slow and land late.

    An async collective writes into a scratch buffer while its real output holds NaN; the
    result is copied over only when the work is waited on, after ``seconds``. Code that reads a
    result before waiting for it -- a missing ``wait()`` or a wrong ordering between overlapped
    steps -- then computes with NaN, which a numerics test sees. ``delayed`` counts how many
    collectives were delayed. Synchronous collectives pass through unchanged.

    >>> with shardline.engine.use_collectives(model, DelayedCollectives(0.005)):
    ...     loss.backward()
    """

    def __init__(self, seconds: float, inner: Collectives | None = None) -> None:
        super().__init__(inner)
        self.seconds = float(seconds)
        self.delayed = 0

    def _delay(self, output: torch.Tensor, issue: Callable[[torch.Tensor], Work | None]) -> Work:
        scratch = output.clone()
        work = issue(scratch)
        if output.is_floating_point():
            output.fill_(float("nan"))
        self.delayed += 1
        return _DelayedWork(work, self.seconds, lambda: output.copy_(scratch))

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, *, async_op: bool
    ) -> Work | None:
        if not async_op:
            return self.inner.all_gather(output, input, group, async_op=False)
        return self._delay(output, lambda out: self.inner.all_gather(out, input, group, async_op=True))

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: dist.ProcessGroup,
        *,
        op: dist.ReduceOp.RedOpType,
        async_op: bool,
    ) -> Work | None:
        if not async_op:
            return self.inner.reduce_scatter(output, input, group, op=op, async_op=False)
        return self._delay(output, lambda out: self.inner.reduce_scatter(out, input, group, op=op, async_op=True))

    def all_reduce(
        self, tensor: torch.Tensor, group: dist.ProcessGroup, *, op: dist.ReduceOp.RedOpType, async_op: bool
    ) -> Work | None:
        if not async_op:
            return self.inner.all_reduce(tensor, group, op=op, async_op=False)
        return self._delay(tensor, lambda out: self.inner.all_reduce(out, group, op=op, async_op=True))

    def all_gather_in_place(self, buffer: torch.Tensor, group: dist.ProcessGroup, *, async_op: bool) -> Work | None:
        inner = _in_place(self.inner)
        if not async_op:
            return inner(buffer, group, async_op=False)
        return self._delay(buffer, lambda out: inner(out, group, async_op=True))


class GradientFault(str, enum.Enum):
    """A bug in gradient reduction, injected to prove that a parity check would see it."""

    MISSING_REDUCTION = "missing_reduction"
    """Averaging reductions do nothing: each rank keeps its own, unreduced gradients."""
    SUM_NOT_MEAN = "sum_not_mean"
    """Averaging reductions sum instead: gradients come out ``group size`` times too large."""


class _Done:
    """Work handle of a collective that did nothing."""

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class FaultyCollectives(_Forwarding):
    """Inject a :class:`GradientFault` into every averaging reduction; everything else passes through.

    Gradients are the only tensors shardline averages, so gathers, norms (sums and maxima) and
    broadcasts stay right. A parity test that still passes with this backend cannot see the
    bug it stands for.

    >>> with shardline.engine.use_collectives(model, FaultyCollectives("sum_not_mean")):
    ...     loss.backward()
    """

    def __init__(self, fault: GradientFault | str, inner: Collectives | None = None) -> None:
        super().__init__(inner)
        self.fault = GradientFault(fault)
        self.injected = 0

    def _op(self, op: dist.ReduceOp.RedOpType) -> dist.ReduceOp.RedOpType | None:
        """The op to run instead of ``op``, or None to skip the reduction."""
        if op != dist.ReduceOp.AVG:
            return op
        self.injected += 1
        return None if self.fault is GradientFault.MISSING_REDUCTION else dist.ReduceOp.SUM

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: dist.ProcessGroup,
        *,
        op: dist.ReduceOp.RedOpType,
        async_op: bool,
    ) -> Work | None:
        run = self._op(op)
        if run is None:  # this rank's rows, unreduced
            output.copy_(input.view(dist.get_world_size(group), -1)[dist.get_rank(group)].view_as(output))
            return _Done() if async_op else None
        return self.inner.reduce_scatter(output, input, group, op=run, async_op=async_op)

    def all_reduce(
        self, tensor: torch.Tensor, group: dist.ProcessGroup, *, op: dist.ReduceOp.RedOpType, async_op: bool
    ) -> Work | None:
        run = self._op(op)
        if run is None:
            return _Done() if async_op else None
        return self.inner.all_reduce(tensor, group, op=run, async_op=async_op)
