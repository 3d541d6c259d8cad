"""A unit: the parameters one ``fully_shard`` call manages, and their collectives.

This module moves data (gather, free, reduce); when those happen is decided by the hooks in
:mod:`shardline.engine.state`.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.autograd.profiler import record_function
from torch.distributed.tensor import DTensor, Replicate, Shard

from shardline import _torch_compat
from shardline.engine import comm
from shardline.engine.layout import FlatLayout, ParamLayout
from shardline.engine.memory import TRACKER, nbytes
from shardline.engine.mesh import ShardMesh
from shardline.engine.mixed_precision import MixedPrecision
from shardline.engine.param import ShardedParam, alias
from shardline.engine.strategy import ShardingStrategy

__all__ = ["PendingReduce", "ShardUnit", "TrainingState", "label"]


def label(name: str) -> Any:
    """A ``torch.profiler`` range named ``shardline::<name>`` while profiling; free otherwise."""
    if _torch_compat.profiling_enabled():
        return record_function(f"shardline::{name}")
    return contextlib.nullcontext()


class TrainingState(enum.Enum):
    """Where a unit is in the current step."""

    IDLE = "idle"
    FORWARD = "forward"
    PRE_BACKWARD = "pre_backward"
    POST_BACKWARD = "post_backward"


@dataclass
class PendingGather:
    """An all-gather of a unit's shards that was started (possibly asynchronously) and not yet copied out."""

    work: Any
    gathered: torch.Tensor
    send: torch.Tensor
    buffer_bytes: int

    def wait(self) -> None:
        if self.work is not None:
            with label("all_gather_wait"):
                self.work.wait()
            self.work = None


@dataclass
class PendingReduce:
    """A gradient reduction that was issued asynchronously and still has to land in ``.grad``."""

    unit: ShardUnit
    work: Any
    output: torch.Tensor
    params: list[ShardedParam]
    layout: FlatLayout
    packed: torch.Tensor | None = None  # the collective's input: alive until it completes
    buffer_bytes: int = 0  # what this reduction added to the tracked communication buffers
    direct: list[torch.Tensor | None] | None = None  # one rank, no replicas: the gradients as they are

    def finish(self) -> None:
        """Wait for the collective and accumulate this rank's reduced shard into the shard grads."""
        if self.work is not None:
            with label(f"reduce_wait {self.unit.display_name}"):
                self.work.wait()
        self.packed = None
        TRACKER.add("comm_buffers", -self.buffer_bytes)
        if self.direct is not None:
            self._finish_direct(self.direct)
            return
        out = self.output
        master = self.unit.master_dtype
        if out.dtype != master:
            out = out.to(master)
        for sp, pl, offset in zip(self.params, self.layout.params, self.layout.offsets, strict=True):
            grad = out[offset : offset + pl.local_numel].view(pl.local_shape)
            if sp.sharded.grad is None:
                sp.sharded.grad = grad
            else:
                sp.sharded.grad += grad

    def _finish_direct(self, grads: list[torch.Tensor | None]) -> None:
        master = self.unit.master_dtype
        for sp, grad in zip(self.params, grads, strict=True):
            if grad is None:
                continue
            grad = grad.view(sp.layout.local_shape)
            if grad.dtype != master:
                grad = grad.to(master)
            if sp.sharded.grad is None:
                sp.sharded.grad = grad
            else:
                sp.sharded.grad += grad


class ShardUnit:
    """The sharded state of one ``fully_shard``-ed module (see ``fully_shard`` for the semantics).

    Parameters of a unit live in one flat buffer per rank (``flat_shard``, master dtype); the
    ``nn.Parameter`` objects registered on the modules are views into it, so an optimizer
    updates the buffer in place and the next all-gather sends it without a copy.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        params: Sequence[tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]],
        mesh: ShardMesh,
        strategy: ShardingStrategy,
        reshard_after_forward: bool | None,
        mixed_precision: MixedPrecision | None,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.module = module
        self.name = ""
        self.mesh = mesh
        self.strategy = strategy
        self.policy = strategy.policy
        self.reshard_after_forward_arg = reshard_after_forward
        self.mixed_precision = mixed_precision or MixedPrecision()
        self.device = device
        self.master_dtype = dtype
        self.compute_dtype = self.mixed_precision.compute_dtype(dtype)
        self.reduce_dtype = self.mixed_precision.gradient_reduce_dtype(dtype)
        # Shard group of one and no cast: gathered parameters can alias the shards themselves.
        self.aliased = mesh.shard_size == 1 and self.compute_dtype == dtype
        self.is_root = True  # until a fully_shard on an ancestor claims this unit
        self.last_in_forward = False  # ran last in its root's previous forward

        world, rank = mesh.shard_size, mesh.shard_rank
        layouts = [ParamLayout.build(p.shape, world, rank) for _, p, _ in params]
        self.layout = FlatLayout.build(layouts, world)
        self.flat_shard = torch.zeros(self.layout.shard_numel, dtype=dtype, device=device)
        self.params: list[ShardedParam] = []
        with torch.no_grad():
            for (fqn, original, locations), pl, offset in zip(params, layouts, self.layout.offsets, strict=True):
                piece = self.flat_shard[offset : offset + pl.local_numel].view(pl.local_shape)
                if device.type != "meta" and pl.local_rows:
                    rows = original.detach().reshape(pl.rows, *pl.row_shape)
                    piece.copy_(rows[pl.row_start : pl.row_start + pl.local_rows])
                sharded = nn.Parameter(alias(piece), requires_grad=original.requires_grad)
                sp = ShardedParam(fqn=fqn, locations=locations, layout=pl, sharded=sharded)
                sp.register(sharded)
                self.params.append(sp)

        self._unsharded_flat: torch.Tensor | None = None
        self._pending_gather: PendingGather | None = None
        self.forward_prefetch = True
        self.backward_prefetch: str | None = "backward_pre"
        self.forward_order: list[ShardUnit] | None = None  # a root's units in forward order (last step)
        self.forward_position: dict[int, int] = {}
        self.root: ShardUnit | None = None  # the root whose forward last ran this unit
        self.is_unsharded = False
        self.pinned = False  # gathered by an explicit unshard(); only reshard() frees it
        self.sync_gradients = True
        self.state = TrainingState.IDLE
        self.post_backward_done = False
        self.forward_leftover = False  # still gathered after a forward that had no backward yet
        self._ready_count = 0
        self._trainable_count = 0
        self._grad_layouts: dict[tuple[bool, ...], FlatLayout] = {}
        self.subtree: list[ShardUnit] | None = None  # units under this one, computed lazily
        # Original dtypes of buffers that MixedPrecision.buffer_dtype cast, keyed by (module, name).
        self.buffer_dtypes: dict[tuple[nn.Module, str], torch.dtype] = {}

    def set_forward_order(self, order: list[ShardUnit]) -> None:
        """Record (on a root) the order its units ran in, which drives prefetching next step."""
        self.forward_order = order
        self.forward_position = {id(u): i for i, u in enumerate(order)}
        last = next((u for u in reversed(order) if not u.is_root), None)
        for unit in order:
            unit.last_in_forward = unit is last

    # ------------------------------------------------------------------ policy
    @property
    def reshard_after_forward(self) -> bool:
        """Whether gathered parameters are freed after forward.

        With ``reshard_after_forward=None``: the strategy's default, except for root units and for
        the unit that ran last in the previous forward -- backward starts with exactly these, so
        freeing them would only mean gathering them again at once.
        """
        if not self.policy.shard_params:
            return False
        if self.reshard_after_forward_arg is not None:
            return self.reshard_after_forward_arg
        if self.is_root or self.last_in_forward:
            return False
        return self.policy.reshard_after_forward

    @property
    def display_name(self) -> str:
        return self.name or "<root>"

    def __repr__(self) -> str:
        return (
            f"ShardUnit({self.display_name!r}, strategy={self.strategy.value}, params={len(self.params)}, "
            f"shard={self.mesh.shard_size}x replicate={self.mesh.replicate_size})"
        )

    # ------------------------------------------------------------------ gather / free
    def unshard(self, phase: str) -> None:
        """Gather full parameters (in the compute dtype) and register them on the modules.

        Finishes a gather that :meth:`prefetch` started, if there is one.
        """
        if self.is_unsharded:
            return
        if self.params:
            if self.aliased:
                self._check_shards_in_place()
                flat = self.flat_shard
            else:
                flat = self._alloc_unsharded_flat()
                if self.mesh.shard_size == 1:
                    self._check_shards_in_place()
                    flat.copy_(self.flat_shard)  # a cast only
                else:
                    pending, self._pending_gather = self._pending_gather, None
                    if pending is None:
                        pending = self._start_all_gather(self.compute_dtype, phase, async_op=False)
                    self._finish_all_gather(pending, flat)
            if self.params[0].unsharded is None:
                self._create_unsharded_params(flat)
            self._sync_requires_grad()
            for sp in self.params:
                sp.register(sp.unsharded)
        self.is_unsharded = True

    def prefetch(self, phase: str) -> bool:
        """Start gathering this unit asynchronously, so the transfer overlaps other work.

        A no-op (False) when the unit is gathered, a gather is already in flight, or there is
        nothing to communicate. The next :meth:`unshard` finishes it.
        """
        if self.is_unsharded or self._pending_gather is not None or not self.params or self.mesh.shard_size == 1:
            return False
        self._pending_gather = self._start_all_gather(self.compute_dtype, phase, async_op=True)
        return True

    def cancel_prefetch(self) -> None:
        """Drop a gather that was started but will not be used (it completes first: collectives must)."""
        pending, self._pending_gather = self._pending_gather, None
        if pending is not None:
            pending.wait()
            TRACKER.add("comm_buffers", -pending.buffer_bytes)

    def reshard(self) -> None:
        """Register the shards again and free the gathered parameters' memory."""
        if not self.is_unsharded:
            return
        for sp in self.params:
            sp.register(sp.sharded)
        if self._unsharded_flat is not None:
            storage = self._unsharded_flat.untyped_storage()
            TRACKER.add("unsharded_params", -storage.nbytes())
            storage.resize_(0)
        self.is_unsharded = False
        self.forward_leftover = False

    def _alloc_unsharded_flat(self) -> torch.Tensor:
        flat = self._unsharded_flat
        if flat is None:
            flat = torch.empty(self.layout.unsharded_numel, dtype=self.compute_dtype, device=self.device)
            self._unsharded_flat = flat
        else:
            flat.untyped_storage().resize_(nbytes(flat))
        TRACKER.add("unsharded_params", nbytes(flat))
        return flat

    def _start_all_gather(self, dtype: torch.dtype, phase: str, *, async_op: bool) -> PendingGather:
        """Issue the all-gather of the shards (cast to ``dtype``) into a rank-major buffer."""
        self._check_shards_in_place()
        world = self.mesh.shard_size
        send = self.flat_shard if dtype == self.master_dtype else self.flat_shard.to(dtype)
        gathered = torch.empty(world * self.layout.shard_numel, dtype=dtype, device=self.device)
        buffers = nbytes(gathered) + (nbytes(send) if send is not self.flat_shard else 0)
        TRACKER.add("comm_buffers", buffers)
        with label(f"all_gather {self.display_name}"):
            work = comm.all_gather(
                gathered, send, self.mesh.shard_group, unit=self.display_name, phase=phase, async_op=async_op
            )
        return PendingGather(work, gathered, send, buffers)

    def _finish_all_gather(self, pending: PendingGather, flat: torch.Tensor) -> None:
        """Wait for ``pending`` and copy it out into the parameter-major buffer ``flat``."""
        pending.wait()
        layout, world = self.layout, self.mesh.shard_size
        # Copy-out: column block i of the (world, S) view is parameter i's padded rows in order.
        outs = [
            flat[offset : offset + world * pl.padded_numel].view(world, pl.padded_numel)
            for pl, offset in zip(layout.params, layout.unsharded_offsets, strict=True)
        ]
        with label(f"copy_out {self.display_name}"):
            torch.split_with_sizes_copy(pending.gathered.view(world, -1), layout.padded_sizes, dim=1, out=outs)
        TRACKER.add("comm_buffers", -pending.buffer_bytes)

    def _create_unsharded_params(self, flat: torch.Tensor) -> None:
        for sp, offset in zip(self.params, self.layout.unsharded_offsets, strict=True):
            pl = sp.layout
            full = alias(flat)[offset : offset + pl.numel].view(pl.shape)
            sp.unsharded = nn.Parameter(full, requires_grad=sp.sharded.requires_grad)

    def _sync_requires_grad(self) -> None:
        """Mirror each shard's ``requires_grad`` (it may change between steps) on its gathered parameter."""
        from shardline.engine.state import on_grad_ready  # the hook belongs to the state machine

        self._trainable_count = 0
        for index, sp in enumerate(self.params):
            wanted = sp.sharded.requires_grad
            if sp.unsharded.requires_grad != wanted:
                sp.unsharded.requires_grad_(wanted)
            if wanted:
                self._trainable_count += 1
                if not sp.hooked:  # hooks can only be registered on tensors that require grad
                    sp.unsharded.register_post_accumulate_grad_hook(_GradReadyHook(self, index, on_grad_ready))
                    sp.hooked = True

    def _check_shards_in_place(self) -> None:
        """Re-adopt shards whose ``.data`` was replaced (e.g. ``param.data = t``) into the flat buffer.

        Runs before every gather, so it only compares addresses (cached per parameter) and does
        real work only for a shard that moved.
        """
        base, size = self.flat_shard.data_ptr(), self.flat_shard.element_size()
        for sp, offset in zip(self.params, self.layout.offsets, strict=True):
            if not sp.layout.local_numel or sp.sharded.data_ptr() == base + offset * size:
                continue
            self._readopt(sp, offset)

    def _readopt(self, sp: ShardedParam, offset: int) -> None:
        data = sp.sharded.data
        if data.shape != sp.layout.local_shape or data.dtype != self.master_dtype or data.device != self.device:
            from shardline.errors import ShardingError

            raise ShardingError(
                f"the shard of parameter '{sp.fqn}' in unit {self.display_name!r} was replaced by a "
                f"tensor of shape {tuple(data.shape)}, dtype {data.dtype}, device {data.device}; expected "
                f"shape {sp.layout.local_shape}, {self.master_dtype} on {self.device}. Move or cast the "
                "model before calling fully_shard, not after."
            )
        piece = self.flat_shard[offset : offset + sp.layout.local_numel]
        with torch.no_grad():
            piece.copy_(data.reshape(-1))
        sp.sharded.data = alias(piece).view(sp.layout.local_shape)

    # ------------------------------------------------------------------ gradients
    def trainable_params(self) -> list[ShardedParam]:
        return [sp for sp in self.params if sp.sharded.requires_grad]

    def grad_layout(self, params: list[ShardedParam]) -> FlatLayout:
        """Flat layout of the trainable parameters (frozen ones send no gradient bytes)."""
        key = tuple(sp.sharded.requires_grad for sp in self.params)
        layout = self._grad_layouts.get(key)
        if layout is None:
            layout = FlatLayout.build([sp.layout for sp in params], self.mesh.shard_size)
            self._grad_layouts[key] = layout
        return layout

    def has_unsharded_grads(self) -> bool:
        return any(sp.unsharded is not None and sp.unsharded.grad is not None for sp in self.params) or any(
            sp.accumulated_grad is not None for sp in self.params
        )

    def reduce_gradients(self) -> PendingReduce | None:
        with label(f"reduce {self.display_name}"):
            return self._reduce_gradients()

    def _reduce_gradients(self) -> PendingReduce | None:
        """Pack the gathered gradients and start their reduction (asynchronously).

        Returns the pending reduction, or None when no parameter of the unit has a gradient.
        Parameters without a gradient on this rank contribute zeros when others have one.
        """
        params = self.trainable_params()
        grads = [sp.unsharded_grad() for sp in params]
        if all(g is None for g in grads):
            return None
        for sp in params:
            sp.clear_unsharded_grad()
        layout = self.grad_layout(params)
        dtype, world = self.reduce_dtype, self.mesh.shard_size
        if world == 1 and self.mesh.replicate_size == 1 and all(g is None or g.is_contiguous() for g in grads):
            # One rank and no replicas: nothing to reduce or pack; hand the gradients over as they
            # are (same values as averaging over one rank, bit for bit). Missing ones stay None.
            return PendingReduce(self, None, grads[0], params, layout, direct=grads)
        name = self.display_name
        packed = None
        if world > 1:
            packed = torch.empty(world, layout.shard_numel, dtype=dtype, device=self.device)
            torch.cat(
                [pack_rows(g, pl, world, dtype, self.device) for g, pl in zip(grads, layout.params, strict=True)],
                dim=1,
                out=packed,
            )
            output = torch.empty(layout.shard_numel, dtype=dtype, device=self.device)
            work = comm.reduce_scatter(
                output, packed.view(-1), self.mesh.shard_group, op=dist.ReduceOp.AVG,
                unit=name, phase="backward", async_op=True,
            )  # fmt: skip
            if self.mesh.replicate_size > 1:
                work.wait()
                work = None
        else:
            if len(grads) == 1 and grads[0] is not None and grads[0].dtype == dtype and grads[0].is_contiguous():
                output = grads[0].view(-1)  # the gradient itself: no copy, nothing new allocated
            else:
                output = torch.cat(
                    [
                        pack_rows(g, pl, 1, dtype, self.device).view(-1)
                        for g, pl in zip(grads, layout.params, strict=True)
                    ]
                )
            work = None
        if self.mesh.replicate_size > 1:
            work = comm.all_reduce(
                output,
                self.mesh.replicate_group,
                op=dist.ReduceOp.AVG,
                unit=name,
                phase="backward",
                async_op=True,
            )
        fresh_output = all(_ptr(output) != _ptr(g) for g in grads)
        held = (nbytes(packed) if packed is not None else 0) + (nbytes(output) if fresh_output else 0)
        TRACKER.add("comm_buffers", held)
        return PendingReduce(self, work, output, params, layout, packed=packed, buffer_bytes=held)

    def accumulate_unsynced(self) -> None:
        """Under ``no_sync``: keep gradients unreduced; widen them to the reduce dtype if it is wider."""
        for sp in self.trainable_params():
            grad = sp.unsharded.grad if sp.unsharded is not None else None
            if grad is None or grad.dtype == self.reduce_dtype:
                continue
            if sp.accumulated_grad is None:
                sp.accumulated_grad = grad.to(self.reduce_dtype)
            else:
                sp.accumulated_grad.add_(grad)
            sp.unsharded.grad = None

    def reset_backward_state(self) -> None:
        self.state = TrainingState.IDLE
        self.post_backward_done = False
        self.forward_leftover = False
        self._ready_count = 0
        for sp in self.params:
            sp.grad_ready = False

    def mark_grad_ready(self, index: int) -> bool:
        """Record that parameter ``index`` got its gradient; True once every trainable one has."""
        sp = self.params[index]
        if not sp.grad_ready:
            sp.grad_ready = True
            self._ready_count += 1
        return self._ready_count >= self._trainable_count

    # ------------------------------------------------------------------ whole tensors
    def gather_full(self, *, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        """Every parameter of the unit as a full tensor (a collective over the shard group).

        Returns new tensors in ``dtype`` (default: master dtype) that share nothing with the
        unit's buffers. Works whether the unit is currently sharded or not.
        """
        dtype = dtype or self.master_dtype
        if not self.params:
            return []
        self._check_shards_in_place()
        if self.mesh.shard_size == 1:
            flat = self.flat_shard.to(dtype, copy=True)
        else:
            flat = torch.empty(self.layout.unsharded_numel, dtype=dtype, device=self.device)
            self._finish_all_gather(self._start_all_gather(dtype, "state_dict", async_op=False), flat)
        return [
            flat[offset : offset + sp.layout.numel].view(sp.layout.shape)
            for sp, offset in zip(self.params, self.layout.unsharded_offsets, strict=True)
        ]

    @torch.no_grad()
    def load_full(self, index: int, full: torch.Tensor) -> None:
        """Copy this rank's rows of the full tensor ``full`` into parameter ``index``'s shard."""
        sp = self.params[index]
        pl, offset = sp.layout, self.layout.offsets[index]
        if not pl.local_rows:
            return
        rows = full.reshape(pl.rows, *pl.row_shape)[pl.row_start : pl.row_start + pl.local_rows]
        self.flat_shard[offset : offset + pl.local_numel].view(pl.local_shape).copy_(rows)

    def materialize(self, device: torch.device) -> None:
        """Give a unit built on the meta device real (zeroed) shard storage on ``device``."""
        self.cancel_prefetch()
        self.reshard()
        self.flat_shard = torch.zeros(self.layout.shard_numel, dtype=self.master_dtype, device=device)
        self.device = device
        self._unsharded_flat = None  # gathered parameters are recreated on the new device
        for sp in self.params:
            sp.unsharded, sp.hooked = None, False
        for sp, offset in zip(self.params, self.layout.offsets, strict=True):
            piece = self.flat_shard[offset : offset + sp.layout.local_numel].view(sp.layout.local_shape)
            fresh = nn.Parameter(alias(piece), requires_grad=sp.sharded.requires_grad)
            fresh.__dict__.update(sp.sharded.__dict__)  # swap_tensors swaps Python attributes too
            torch.utils.swap_tensors(sp.sharded, fresh)  # keeps the Parameter object optimizers hold

    def to_dtensor(self, sp: ShardedParam) -> DTensor:
        """This rank's piece of ``sp`` as a DTensor that shares the shard's memory (no copy).

        ``Shard(0)`` over the shard group for sharded units, ``Replicate()`` for NO_SHARD units.
        0-d parameters appear with shape ``(1,)``.
        """
        mesh = self.mesh.device_mesh_for(self.device.type)
        placement = Shard(0) if self.mesh.shard_size > 1 else Replicate()
        shape = (sp.layout.rows, *sp.layout.row_shape)
        return DTensor.from_local(
            sp.sharded.data,
            mesh,
            [placement],
            run_check=False,
            shape=torch.Size(shape),
            stride=_contiguous_stride(shape),
        )


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


class _GradReadyHook:
    """Post-accumulate-grad hook of one gathered parameter (a class so it carries no closure cycle)."""

    __slots__ = ("callback", "index", "unit")

    def __init__(self, unit: ShardUnit, index: int, callback: Any) -> None:
        self.unit, self.index, self.callback = unit, index, callback

    def __call__(self, _param: torch.Tensor) -> None:
        self.callback(self.unit, self.index)


def _ptr(tensor: torch.Tensor | None) -> int:
    return tensor.untyped_storage().data_ptr() if tensor is not None else -1


def pack_rows(
    grad: torch.Tensor | None, pl: ParamLayout, world: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``grad`` as ``(world, chunk * row_numel)``: rows zero-padded to ``world * chunk``, in ``dtype``."""
    if grad is None:
        return torch.zeros(world, pl.padded_numel, dtype=dtype, device=device)
    rows = grad.reshape(pl.rows, pl.row_numel)
    if rows.dtype != dtype:
        rows = rows.to(dtype)
    pad = world * pl.chunk - pl.rows
    if pad:
        rows = F.pad(rows, (0, 0, 0, pad))
    return rows.view(world, pl.padded_numel)
