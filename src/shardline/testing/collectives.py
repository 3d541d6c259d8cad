"""Communication backends for tests and fault drills, injected with ``shardline.engine.use_collectives``."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from shardline.engine import Collectives, TorchCollectives

__all__ = ["DelayedCollectives"]


class _DelayedWork:
    """An async collective whose result only appears, late, when waited on."""

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


class DelayedCollectives:
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
        self.seconds = float(seconds)
        self.inner: Collectives = inner or TorchCollectives()
        self.delayed = 0

    def _delay(self, output: torch.Tensor, issue: Any) -> Any:
        scratch = output.clone()
        work = issue(scratch)
        if output.is_floating_point():
            output.fill_(float("nan"))
        self.delayed += 1
        return _DelayedWork(work, self.seconds, lambda: output.copy_(scratch))

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, *, async_op: bool) -> Any:
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
    ) -> Any:
        if not async_op:
            return self.inner.reduce_scatter(output, input, group, op=op, async_op=False)
        return self._delay(output, lambda out: self.inner.reduce_scatter(out, input, group, op=op, async_op=True))

    def all_reduce(
        self, tensor: torch.Tensor, group: dist.ProcessGroup, *, op: dist.ReduceOp.RedOpType, async_op: bool
    ) -> Any:
        if not async_op:
            return self.inner.all_reduce(tensor, group, op=op, async_op=False)
        return self._delay(tensor, lambda out: self.inner.all_reduce(out, group, op=op, async_op=True))

    def gathers_in_place(self, group: dist.ProcessGroup, *, numel: int, dtype: torch.dtype, device: Any) -> bool:
        check = getattr(self.inner, "gathers_in_place", None)
        return bool(check is not None and check(group, numel=numel, dtype=dtype, device=device))

    def all_gather_in_place(self, buffer: torch.Tensor, group: dist.ProcessGroup, *, async_op: bool) -> Any:
        inner = self.inner.all_gather_in_place  # type: ignore[attr-defined]
        if not async_op:
            return inner(buffer, group, async_op=False)
        return self._delay(buffer, lambda out: inner(out, group, async_op=True))

    def broadcast(self, tensor: torch.Tensor, group: dist.ProcessGroup, *, src: int) -> None:
        self.inner.broadcast(tensor, group, src=src)

    def scatter(
        self, output: torch.Tensor, chunks: list[torch.Tensor] | None, group: dist.ProcessGroup, *, src: int
    ) -> None:
        self.inner.scatter(output, chunks, group, src=src)
