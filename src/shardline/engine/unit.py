"""A unit: the parameters one ``fully_shard`` call manages, where they are, and what each step did to them.

The unit moves data through its :class:`~shardline.engine.flat.FlatGroup` s (one per master
dtype); when it does so is decided by the hooks in :mod:`shardline.engine.hooks`.

Note: the unit's residency. Where a unit's parameters are is one state, changed only by the
methods named beside each arrow::

    SHARDED --prefetch--> PREFETCHING --unshard--> GATHERED --reshard--> SHARDED
    SHARDED --unshard---------------------------> GATHERED
    PREFETCHING --cancel_prefetch--> SHARDED (or PARTIAL, when it was gathering from there)
    GATHERED --reshard(after_forward, N)--> PARTIAL --prefetch/unshard--> PREFETCHING/GATHERED
    PARTIAL --reshard--> SHARDED
    any --pin--> PINNED --unpin--> GATHERED      (an explicit ``module.unshard()``)

``PARTIAL`` is ``reshard_after_forward=N``: after forward the unit keeps its parameters split
over groups of ``N`` ranks, so backward gathers over those only.

What the current backward pass has done to the unit (which gradients arrived, whether they
were reduced) is a separate record, :class:`BackwardProgress`, reset as a whole when the pass
ends.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from shardline.engine.comm import Comm
from shardline.engine.flat import FlatGroup, flat_group
from shardline.engine.memory import MemoryTracker
from shardline.engine.mesh import ShardMesh
from shardline.engine.mixed_precision import MixedPrecision
from shardline.engine.offload import CPUOffload, HostCopies, OffloadPolicy
from shardline.engine.param import ShardedParam
from shardline.engine.pending import PendingReduce
from shardline.engine.profiling import label
from shardline.engine.quantized import QuantizedGroup
from shardline.engine.strategy import ShardingStrategy

__all__ = ["BackwardProgress", "Residency", "ShardUnit", "UnitContext"]


class Residency(enum.Enum):
    """Where a unit's parameters are (see the module note for the transitions)."""

    SHARDED = "sharded"
    """Shards registered on the modules; nothing gathered."""
    PREFETCHING = "prefetching"
    """An asynchronous all-gather is in flight; shards still registered."""
    GATHERED = "gathered"
    """Full parameters registered, for forward and backward."""
    PINNED = "pinned"
    """Gathered by an explicit ``unshard()``; only ``reshard()`` frees it."""
    PARTIAL = "partial"
    """Shards registered, and the gathered parameters kept split over the post-forward group for backward."""


@dataclass
class BackwardProgress:
    """What the current backward pass has done to a unit."""

    ready: set[int] = field(default_factory=set)  # indices of trainable parameters whose gradient arrived
    reduced: bool = False  # the gradients were reduced (or, under no_sync, set aside)


GradReadyCallback = Callable[["ShardUnit", int], None]


class UnitContext(Protocol):
    """What a unit needs of the context of its tree (a ``RootContext``): accounts to move data through."""

    comm: Comm
    memory: MemoryTracker


class ShardUnit:
    """The sharded state of one ``fully_shard``-ed module (see ``fully_shard`` for the semantics)."""

    def __init__(
        self,
        module: nn.Module,
        *,
        params: Sequence[tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]],
        mesh: ShardMesh,
        strategy: ShardingStrategy,
        reshard_after_forward: bool | int | None,
        mixed_precision: MixedPrecision | None,
        device: torch.device,
        offload: OffloadPolicy | None = None,
        quantized: Sequence[tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]] = (),
    ) -> None:
        self.module = module
        self.name = ""
        self.mesh = mesh
        self.strategy = strategy
        self.policy = strategy.policy
        self.reshard_after_forward_arg = reshard_after_forward
        self.mixed_precision = mixed_precision or MixedPrecision()
        self.device = device
        self.offload = offload if isinstance(offload, CPUOffload) else None
        self.ctx: UnitContext  # the tree's RootContext, set by RootContext.adopt
        self.is_root = True  # until a fully_shard on an ancestor claims this unit
        self.last_in_forward = False  # ran last in its forward root's previous forward

        replicated = self.policy.shard_optimizer and not self.policy.shard_params  # ZeRO-1
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, (_, p, _) in enumerate(params):
            by_dtype.setdefault(p.dtype, []).append(i)
        self.groups: list[FlatGroup] = []
        slots: list[ShardedParam | None] = [None] * len(params)
        for dtype, indices in by_dtype.items():
            group = FlatGroup(
                [params[i] for i in indices],
                dtype=dtype,
                compute_dtype=self.mixed_precision.compute_dtype(dtype),
                reduce_dtype=self.mixed_precision.gradient_reduce_dtype(dtype),
                mesh=mesh,
                device=device,
                replicated=replicated,
                offload=HostCopies(self.offload, device) if self.offload is not None else None,
            )
            self.groups.append(group)
            for i, sp in zip(indices, group.params, strict=True):
                sp.group = group
                slots[i] = sp
        self.params: list[ShardedParam] = [sp for sp in slots if sp is not None]
        # Frozen 4-bit (NF4) weights: outside the flat buffers (see engine/quantized.py).
        self.quantized: QuantizedGroup | None = (
            QuantizedGroup(
                quantized,
                mesh=mesh,
                device=device,
                shard=self.policy.shard_params,
                offload=HostCopies(self.offload, device) if self.offload is not None else None,
            )
            if quantized
            else None
        )

        self.residency = Residency.SHARDED
        self.progress = BackwardProgress()
        self.grad_ready_callback: GradReadyCallback | None = None  # set by the hooks
        self.forward_prefetch = True
        self.backward_prefetch: str | None = "backward_pre"
        self.forward_order: list[ShardUnit] | None = None  # as forward root: its units in order (last step)
        self.forward_position: dict[int, int] = {}
        self.forward_root_unit: ShardUnit | None = None  # the forward root whose forward last ran this unit
        self.sync_gradients = True
        self.all_reduce_gradients = True  # False: defer the all-reduce across replicas (hybrid no_sync variant)
        self._trainable_count = 0
        self.subtree: list[ShardUnit] | None = None  # units under this one, computed lazily
        # Original dtypes of buffers that MixedPrecision.buffer_dtype cast, keyed by (module, name).
        self.buffer_dtypes: dict[tuple[nn.Module, str], torch.dtype] = {}

    # ------------------------------------------------------------------ description
    @property
    def display_name(self) -> str:
        return self.name or "<root>"

    @property
    def dtypes(self) -> list[torch.dtype]:
        """Master dtypes of the unit's parameter groups."""
        return [g.dtype for g in self.groups]

    @property
    def numel(self) -> int:
        """Elements of the unit's parameters, unsharded."""
        return sum(sp.layout.numel for sp in self.params)

    def __repr__(self) -> str:
        return (
            f"ShardUnit({self.display_name!r}, strategy={self.strategy.value}, params={len(self.params)}, "
            f"shard={self.mesh.shard_size}x replicate={self.mesh.replicate_size})"
        )

    def set_forward_order(self, order: list[ShardUnit]) -> None:
        """Record (on a forward root) the order its units ran in, which drives prefetching next step."""
        self.forward_order = order
        self.forward_position = {id(u): i for i, u in enumerate(order)}
        last = next((u for u in reversed(order) if not u.is_root), None)
        for unit in order:
            unit.last_in_forward = unit is last

    @property
    def reshard_after_forward(self) -> bool:
        """Whether gathered parameters are freed after forward.

        With ``reshard_after_forward=None``: the strategy's default, except for root units and for
        the unit that ran last in the previous forward -- backward starts with exactly these, so
        freeing them would only mean gathering them again at once.
        """
        if not self.policy.shard_params:
            return False
        arg = self.reshard_after_forward_arg
        if arg is not None:
            return arg if isinstance(arg, bool) else arg > 1
        if self.is_root or self.last_in_forward:
            return False
        return self.policy.reshard_after_forward

    @property
    def post_forward_size(self) -> int | None:
        """``N`` of ``reshard_after_forward=N`` (when 1 < N < shard size): ranks parameters stay split over."""
        arg = self.reshard_after_forward_arg
        if isinstance(arg, bool) or arg is None or not self.policy.shard_params:
            return None
        return arg if 1 < arg < self.mesh.shard_size else None

    @property
    def scatters_gradients(self) -> bool:
        """Gradients are reduce-scattered inside the shard group (sharded parameters, more than one rank)."""
        return self.policy.shard_params and self.mesh.shard_size > 1

    @property
    def keeps_gradients_local(self) -> bool:
        """Backward keeps gradients unreduced: ``no_sync``, or the all-reduce deferral for a non-scattering unit."""
        return not self.sync_gradients or (not self.all_reduce_gradients and not self.scatters_gradients)

    # ------------------------------------------------------------------ residency transitions
    @property
    def is_gathered(self) -> bool:
        return self.residency in (Residency.GATHERED, Residency.PINNED)

    @property
    def pinned(self) -> bool:
        return self.residency is Residency.PINNED

    def unshard(self, phase: str) -> None:
        """SHARDED or PREFETCHING -> GATHERED: gather the full parameters and register them on the modules."""
        if self.is_gathered:
            return
        if self.params:
            ctx = self.ctx
            for group in self.groups:
                group.unshard(comm=ctx.comm, memory=ctx.memory, name=self.display_name, phase=phase)
            self._sync_requires_grad()
            for group in self.groups:
                group.register_unsharded()
        if self.quantized is not None:
            ctx = self.ctx
            self.quantized.unshard(comm=ctx.comm, memory=ctx.memory, name=self.display_name, phase=phase)
        self.residency = Residency.GATHERED

    def prefetch(self, phase: str) -> bool:
        """SHARDED or PARTIAL -> PREFETCHING: start gathering asynchronously so the transfer overlaps other work.

        False (and no transition) when the unit is not sharded or there is nothing to communicate;
        the next :meth:`unshard` finishes the gather.
        """
        if self.residency not in (Residency.SHARDED, Residency.PARTIAL) or not self.params:
            return False
        ctx = self.ctx
        started = False
        for group in self.groups:
            started |= group.prefetch(comm=ctx.comm, memory=ctx.memory, name=self.display_name, phase=phase)
        if started:
            self.residency = Residency.PREFETCHING
        return started

    def cancel_prefetch(self) -> None:
        """PREFETCHING -> SHARDED: drop a gather that will not be used (it still completes: collectives must)."""
        if self.residency is not Residency.PREFETCHING:
            return
        for group in self.groups:
            group.cancel_prefetch(self.ctx.memory)
        partial = any(group.holds_post_shard for group in self.groups)
        self.residency = Residency.PARTIAL if partial else Residency.SHARDED

    def reshard(self, *, after_forward: bool = False) -> None:
        """GATHERED or PARTIAL -> SHARDED: register the shards again and free the gathered parameters' memory.

        ``after_forward`` with ``reshard_after_forward=N``: GATHERED -> PARTIAL instead (keep the
        parameters split over the post-forward group). A no-op when sharded, prefetching or pinned
        (an explicit unshard is only undone by :meth:`unpin`).
        """
        if self.residency not in (Residency.GATHERED, Residency.PARTIAL):
            return
        size = self.post_forward_size if after_forward and self.residency is Residency.GATHERED else None
        for group in self.groups:
            if size is not None:
                group.reshard_partial(size, self.ctx.memory)
            else:
                group.free_unsharded(self.ctx.memory)
        if self.quantized is not None:
            self.quantized.free(self.ctx.memory)  # also under a partial reshard: backward gathers it whole
        self.residency = Residency.PARTIAL if size is not None else Residency.SHARDED

    def pin(self) -> None:
        """any -> PINNED: gather now and keep the parameters gathered until :meth:`unpin`."""
        self.unshard(phase="explicit")
        self.residency = Residency.PINNED

    def unpin(self) -> None:
        """PINNED -> GATHERED (then free it with :meth:`reshard`)."""
        if self.residency is Residency.PINNED:
            self.residency = Residency.GATHERED

    def release(self) -> None:
        """Back to SHARDED from anywhere: unpin, cancel a prefetch, free gathered parameters (loads do this)."""
        self.cancel_prefetch()
        self.unpin()
        self.reshard()
        self.mark_updated()  # what follows (a load) writes the shards

    def _sync_requires_grad(self) -> None:
        """Mirror each shard's ``requires_grad`` (it may change between steps) on its gathered parameter."""
        self._trainable_count = 0
        for index, sp in enumerate(self.params):
            wanted = sp.sharded.requires_grad
            unsharded = sp.unsharded
            assert unsharded is not None  # called once gathered
            if unsharded.requires_grad != wanted:
                unsharded.requires_grad_(wanted)
            if wanted:
                self._trainable_count += 1
                if not sp.hooked and self.grad_ready_callback is not None:
                    # Hooks can only be registered on tensors that require grad.
                    unsharded.register_post_accumulate_grad_hook(_GradReadyHook(self, index, self.grad_ready_callback))
                    sp.hooked = True

    # ------------------------------------------------------------------ gradients
    def has_unsharded_grads(self) -> bool:
        """Gradients wait for a reduction: unreduced ones, or partial sums awaiting the replica all-reduce."""
        return (
            any(sp.unsharded is not None and sp.unsharded.grad is not None for sp in self.params)
            or any(sp.accumulated_grad is not None for sp in self.params)
            or (self.all_reduce_gradients and any(group.partial is not None for group in self.groups))
        )

    def mark_grad_ready(self, index: int) -> bool:
        """Record that parameter ``index`` got its gradient; True once every trainable one has."""
        self.progress.ready.add(index)
        return len(self.progress.ready) >= self._trainable_count

    def reduce_gradients(self) -> list[PendingReduce]:
        """Start reducing the gathered gradients of every group that has some (asynchronously)."""
        self.progress.reduced = True
        ctx = self.ctx
        with label(f"reduce {self.display_name}"):
            out = [
                group.reduce_gradients(
                    comm=ctx.comm, memory=ctx.memory, name=self.display_name, all_reduce=self.all_reduce_gradients
                )
                for group in self.groups
            ]
        return [r for r in out if r is not None]

    def accumulate_unsynced(self) -> None:
        """Under ``no_sync``: keep gradients unreduced (widened to the reduce dtype if that is wider)."""
        self.progress.reduced = True
        for group in self.groups:
            group.accumulate_unsynced()

    def mark_updated(self) -> None:
        """Replicated (SHARD_OPT) groups: the optimizer stepped; gather the updated rows before the next forward."""
        for group in self.groups:
            if group.replicated:
                group.mark_updated()

    def reset_backward(self) -> None:
        """Forget what the last backward pass did (its end, or an interrupted one)."""
        self.progress = BackwardProgress()

    # ------------------------------------------------------------------ whole tensors
    def gather_full(self, *, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        """Every parameter of the unit as a full tensor, in ``self.params`` order (a collective).

        Returns new tensors in ``dtype`` (default: each parameter's master dtype) that share
        nothing with the unit's buffers. Works whether the unit is gathered or not.
        """
        full: dict[int, torch.Tensor] = {}
        for group in self.groups:
            tensors = group.gather_full(
                [sp.sharded.detach() for sp in group.params],
                dtype=dtype or group.dtype,
                comm=self.ctx.comm,
                name=self.display_name,
                phase="state_dict",
            )
            for sp, t in zip(group.params, tensors, strict=True):
                assert t is not None
                full[id(sp)] = t
        return [full[id(sp)] for sp in self.params]

    def load_full(self, index: int, full: torch.Tensor) -> None:
        """Copy this rank's rows of the full tensor ``full`` into parameter ``index``'s shard."""
        sp = self.params[index]
        group = flat_group(sp)
        group.load_full(sp, full.to(device=group.master.device, dtype=group.dtype))

    def to_dtensor(self, sp: ShardedParam, local: torch.Tensor | None = None) -> DTensor:
        """``local`` (default: the shard) as a DTensor piece of ``sp``, sharing memory."""
        return flat_group(sp).to_dtensor(sp, local)

    def materialize(self, device: torch.device) -> None:
        """Give a unit built on the meta device real (zeroed) shard storage on ``device``."""
        self.release()
        for group in self.groups:
            group.materialize(device)
        self.device = device


class _GradReadyHook:
    """Post-accumulate-grad hook of one gathered parameter (a class so it carries no closure cycle)."""

    __slots__ = ("callback", "index", "unit")

    def __init__(self, unit: ShardUnit, index: int, callback: GradReadyCallback) -> None:
        self.unit, self.index, self.callback = unit, index, callback

    def __call__(self, _param: torch.Tensor) -> None:
        self.callback(self.unit, self.index)
