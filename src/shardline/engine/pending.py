"""Collectives a :class:`~shardline.engine.flat.FlatGroup` started and has not landed yet.

The group decides every offset (it owns the packing); these records only carry what it
computed until the collective completes: where a gather's output is copied out to, and which
slice of a reduction's output becomes which parameter's gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from shardline.engine.comm import Work
from shardline.engine.layout import FlatLayout
from shardline.engine.memory import MemoryTracker
from shardline.engine.param import ShardedParam
from shardline.engine.profiling import label

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = ["GradSlice", "PartialSum", "PendingGather", "PendingReduce"]


class PartialSum(Protocol):
    """Where a reduction whose all-reduce across replicas is deferred lands: a group's partial sum."""

    def add_partial(self, reduced: torch.Tensor) -> None:
        """Add ``reduced`` to the partial sum awaiting the all-reduce across replicas."""


@dataclass
class PendingGather:
    """An all-gather that was started (possibly asynchronously) and not yet copied out.

    Attributes:
        layout: How the gathered ranks' buffers are packed (the group's layout, or its
            post-forward layout for a partial reshard).
        world: Ranks gathered over.
        group: The process group gathered over.
        in_place: The gather writes the parameter-major buffer directly (``gathered`` is it).
    """

    work: Work | None
    gathered: torch.Tensor
    send: torch.Tensor
    buffer_bytes: int
    layout: FlatLayout
    world: int
    group: dist.ProcessGroup | None = None
    in_place: bool = False  # landed in the parameter-major buffer itself: nothing to copy out
    moves_to_unsharded: int = 0  # bytes counted as a communication buffer until it lands, then as gathered

    def wait(self) -> None:
        if self.work is not None:
            with label("all_gather_wait"):
                self.work.wait()
            self.work = None


@dataclass(frozen=True)
class GradSlice:
    """Where one parameter's reduced gradient sits in a reduction's output (elements)."""

    param: ShardedParam
    start: int
    numel: int
    shape: tuple[int, ...]


@dataclass
class PendingReduce:
    """A gradient reduction issued asynchronously that still has to land.

    It lands either in the shards' ``.grad`` (``slices`` of ``output``), or -- when the
    all-reduce across replicas is deferred -- in ``partial``'s owner, added to its partial sum.

    Note: chained reductions (hybrid sharding). The all-reduce across replicas needs the
    reduce-scatter's output, but nothing else does: waiting for the reduce-scatter right after
    issuing it (as this engine once did) makes the compute stream wait for it too, stalling the
    next unit's backward. So a hybrid reduction carries its second stage in ``then``: it is
    issued by :meth:`advance` -- when the next unit starts its own reduction, or at the end of
    backward -- after waiting for the reduce-scatter alone, and the reduction stays in flight
    until its all-reduce lands. At most one reduce-scatter and one all-reduce are in flight.
    """

    name: str
    memory: MemoryTracker
    master: torch.dtype
    work: Work | None
    output: torch.Tensor | None
    slices: list[GradSlice]
    spare: torch.Tensor | None = None  # the memory tracker's scratch buffer in use: given back once landed
    buffer_bytes: int = 0  # what this reduction added to the tracked communication buffers
    direct: list[torch.Tensor | None] | None = None  # one rank, no replicas: the gradients as they are
    into_partial: PartialSum | None = None  # the FlatGroup whose partial sum receives the output (deferred all-reduce)
    copy_back: list[torch.Tensor | None] | None = None  # gradients that receive their reduced values
    then: Callable[[], Work | None] | None = None  # issues the second collective once ``work`` landed; returns its work
    to_host: Callable[[torch.Tensor], torch.Tensor] | None = None  # CPU offload: copies a reduced shard to the host

    @property
    def chained(self) -> bool:
        """A second collective is still to be issued (see the note on chained reductions)."""
        return self.then is not None

    def advance(self) -> None:
        """Wait for the first collective, give its scratch input back, and issue the second."""
        assert self.then is not None
        if self.work is not None:
            with label(f"reduce_scatter_wait {self.name}"):
                self.work.wait()
        if self.spare is not None:  # the reduce-scatter's input: free once it landed
            self.memory.give(self.spare)
            self.spare = None
        then, self.then = self.then, None
        self.work = then()

    def finish(self) -> None:
        """Wait for the collective(s), then accumulate the result where it belongs."""
        if self.then is not None:
            self.advance()
        if self.work is not None:
            with label(f"reduce_wait {self.name}"):
                self.work.wait()
        self.memory.add("comm_buffers", -self.buffer_bytes)
        try:
            self._land()
        finally:
            if self.spare is not None:
                self.memory.give(self.spare)
                self.spare = None

    def _land(self) -> None:
        if self.direct is not None:
            for piece, grad in zip(self.slices, self.direct, strict=True):
                if grad is not None:
                    accumulate(piece.param, grad.view(piece.shape), self.master, self.to_host)
            return
        out = self.output
        assert out is not None  # only direct reductions have no output buffer
        if self.into_partial is not None:
            self.into_partial.add_partial(out)
            return
        if out.dtype != self.master:
            out = out.to(self.master)
        for i, piece in enumerate(self.slices):
            reduced = out[piece.start : piece.start + piece.numel].view(piece.shape)
            if self.copy_back is not None:  # ``out`` is scratch: the values go back into the gradients
                target = self.copy_back[i]
                reduced = target.view(piece.shape).copy_(reduced) if target is not None else reduced.clone()
            accumulate(piece.param, reduced, self.master, self.to_host)


def accumulate(
    sp: ShardedParam,
    grad: torch.Tensor,
    master: torch.dtype,
    to_host: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """Add ``grad`` to the shard's ``.grad`` (or make it the ``.grad``); first to the host when offloaded."""
    if grad.dtype != master:
        grad = grad.to(master)
    if to_host is not None:
        grad = to_host(grad)
    if sp.sharded.grad is None:
        sp.sharded.grad = grad
    else:
        sp.sharded.grad += grad
