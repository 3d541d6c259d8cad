"""The state shared by the units of one sharded model: one :class:`RootContext` per tree of units.

Note: why per root. Two sharded models in one process -- a policy and a frozen reference, or
a student and a teacher -- must not share step bookkeeping (one model's forward would cancel
the other's prefetches), communication totals or memory accounting. Every ``fully_shard`` call
starts a context for its unit and takes over the contexts of the units below it, so after
sharding a model bottom-up all of its units share the root's context, and nothing is global.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, cast

from torch import nn

from shardline import _torch_compat
from shardline.engine.comm import Comm
from shardline.engine.memory import MemoryTracker
from shardline.engine.registry import subtree_units
from shardline.engine.unit import ShardUnit

if TYPE_CHECKING:
    from collections.abc import Callable

    from shardline.engine.pending import PendingReduce

__all__ = ["RootContext", "contexts_of", "root_context"]

log = logging.getLogger(__name__)


class RootContext:
    """Bookkeeping of one tree of units (hooks may run on autograd's threads).

    Attributes:
        comm: Issues and accounts for the tree's collectives.
        memory: Tracks the tree's gathered parameters and communication buffers.
        units: Every unit of the tree.
        forward_root: The unit whose forward started outside any other unit's forward, while it runs.
        order: Units in pre-forward order during the current root forward.
        prefetched: Units with a gather in flight.
        touched: Units forwarded or backwarded since the last end of backward.
        pending: Gradient reductions in flight (at most one, plus the all-reduce of a chained
            hybrid one: starting one lands or advances the previous).
        callback_queued: The end-of-backward callback is queued on the autograd engine.
    """

    def __init__(self) -> None:
        self.comm = Comm()
        self.memory = MemoryTracker()
        self.units: list[ShardUnit] = []
        self.forward_root: ShardUnit | None = None
        self.order: dict[int, ShardUnit] = {}
        self.prefetched: dict[int, ShardUnit] = {}
        self.touched: dict[int, ShardUnit] = {}
        self.pending: list[PendingReduce] = []
        self.callback_queued = False

    def adopt(self, unit: ShardUnit) -> None:
        """Make ``unit`` a member of this tree."""
        unit.ctx = self
        self.units.append(unit)

    def absorb(self, other: RootContext) -> None:
        """Take over every unit of ``other`` (a parent was sharded above its root)."""
        if other is self:
            return
        for unit in other.units:
            self.adopt(unit)
        other.units = []
        self.comm.absorb(other.comm)
        self.memory.absorb(other.memory)

    # ------------------------------------------------------------------ step bookkeeping
    def prefetch(self, unit: ShardUnit | None, phase: str) -> None:
        if unit is not None and unit.prefetch(phase):
            self.prefetched[id(unit)] = unit

    def cancel_prefetches(self) -> None:
        prefetched, self.prefetched = self.prefetched, {}
        for unit in prefetched.values():
            unit.cancel_prefetch()

    def touch(self, unit: ShardUnit) -> None:
        self.touched.setdefault(id(unit), unit)

    def ensure_final_callback(self, callback: Callable[[RootContext], None]) -> None:
        """Queue ``callback(self)`` to run once the current backward pass has finished (once per pass)."""
        if not self.callback_queued:
            self.callback_queued = True
            _torch_compat.queue_backward_callback(lambda: callback(self))

    def land_pending(self) -> None:
        """Land every reduction in flight (end of backward)."""
        pending, self.pending = self.pending, []
        for reduction in pending:
            reduction.finish()

    def advance_pending(self) -> None:
        """Make room for a new reduction: land those in flight, but only *advance* chained ones.

        A chained (hybrid) reduction whose reduce-scatter is in flight waits for it and issues
        its all-reduce, which stays in flight; everything else lands. So at most one
        reduce-scatter and one all-reduce are in flight (``engine/pending.py``).
        """
        pending, self.pending = self.pending, []
        for reduction in pending:
            if reduction.chained:
                reduction.advance()
                self.pending.append(reduction)
            else:
                reduction.finish()

    def recover_from_interrupted_backward(self) -> None:
        """A backward raised before its end-of-backward callback ran: drop what it left behind."""
        if not self.callback_queued:
            return
        log.warning("shardline: the previous backward pass did not finish; resetting unit states")
        self.callback_queued = False
        self.pending.clear()
        for unit in self.touched.values():
            unit.reset_backward()
        self.touched.clear()


def root_context(unit: ShardUnit) -> RootContext:
    """The context of ``unit``'s tree.

    Note: ``ShardUnit.ctx`` is annotated with the protocol of what a unit itself needs of it, so
    that unit.py does not import this module; :meth:`RootContext.adopt` is the one place that sets
    it, so it is always a :class:`RootContext`.
    """
    return cast(RootContext, unit.ctx)


def contexts_of(module: nn.Module) -> list[RootContext]:
    """The distinct root contexts of the units under ``module`` (one per tree of units)."""
    seen: dict[int, RootContext] = {}
    for unit in subtree_units(module):
        ctx = root_context(unit)
        seen.setdefault(id(ctx), ctx)
    return list(seen.values())
