"""One flat buffer per rank for the parameters of a unit that share a dtype, and every way data moves through it.

This is the only place that knows how a flat buffer is packed (see the note in
:mod:`shardline.engine.layout`): gathering parameters, packing gradients for the
reduce-scatter, gathering any shard-shaped tensors (parameters, optimizer state) to full ones,
slicing a full tensor to this rank's rows, scattering from rank 0, and viewing a shard as a
DTensor. The unit decides *when* these happen; the engine's hooks decide *why*.

Note: why one group per dtype. A LoRA model keeps its frozen base in bf16 and its adapters in
fp32, often inside one decoder layer. Collectives move one dtype at a time, so a unit keeps one
:class:`FlatGroup` per master dtype; each has its own all-gather and (if any of its parameters
train) its own reduce-scatter, and the unit drives them together.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from shardline.engine.comm import Comm
from shardline.engine.layout import FlatLayout, ParamLayout
from shardline.engine.memory import MemoryTracker, nbytes
from shardline.engine.mesh import ShardMesh
from shardline.engine.param import GATHERED_ATTR, ShardedParam, alias
from shardline.engine.profiling import label
from shardline.errors import ShardingError

__all__ = ["FlatGroup", "PendingGather", "PendingReduce"]


@dataclass
class PendingGather:
    """An all-gather of a group's shards that was started (possibly asynchronously) and not yet copied out."""

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
    """A gradient reduction that was issued asynchronously and still has to land in the shards' ``.grad``."""

    group: FlatGroup
    name: str
    memory: MemoryTracker
    work: Any
    output: torch.Tensor | None
    params: list[ShardedParam]
    layout: FlatLayout
    packed: torch.Tensor | None = None  # the collective's input: alive until it completes
    buffer_bytes: int = 0  # what this reduction added to the tracked communication buffers
    direct: list[torch.Tensor | None] | None = None  # one rank, no replicas: the gradients as they are

    def finish(self) -> None:
        """Wait for the collective and accumulate this rank's reduced shard into the shard grads."""
        if self.work is not None:
            with label(f"reduce_wait {self.name}"):
                self.work.wait()
        self.packed = None
        self.memory.add("comm_buffers", -self.buffer_bytes)
        master = self.group.dtype
        if self.direct is not None:
            for sp, grad in zip(self.params, self.direct, strict=True):
                if grad is not None:
                    _accumulate(sp, grad.view(sp.layout.local_shape), master)
            return
        out = self.output
        assert out is not None  # only direct reductions have no output buffer
        if out.dtype != master:
            out = out.to(master)
        for sp, pl, offset in zip(self.params, self.layout.params, self.layout.offsets, strict=True):
            _accumulate(sp, out[offset : offset + pl.local_numel].view(pl.local_shape), master)


def _accumulate(sp: ShardedParam, grad: torch.Tensor, master: torch.dtype) -> None:
    if grad.dtype != master:
        grad = grad.to(master)
    if sp.sharded.grad is None:
        sp.sharded.grad = grad
    else:
        sp.sharded.grad += grad


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


def _ptr(tensor: torch.Tensor | None) -> int:
    return tensor.untyped_storage().data_ptr() if tensor is not None else -1


class FlatGroup:
    """The parameters of one unit that share a master dtype, sharded into one flat buffer per rank.

    The ``nn.Parameter`` objects registered on the modules between steps are views into
    ``flat_shard`` (the master copy), so an optimizer updates the buffer in place and the next
    all-gather sends it without a copy-in.
    """

    def __init__(
        self,
        entries: Sequence[tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]],
        *,
        dtype: torch.dtype,
        compute_dtype: torch.dtype,
        reduce_dtype: torch.dtype,
        mesh: ShardMesh,
        device: torch.device,
    ) -> None:
        self.dtype = dtype
        self.compute_dtype = compute_dtype
        self.reduce_dtype = reduce_dtype
        self.mesh = mesh
        self.device = device
        # Shard group of one and no cast: gathered parameters can alias the shards themselves.
        self.aliased = mesh.shard_size == 1 and compute_dtype == dtype
        world, rank = mesh.shard_size, mesh.shard_rank
        layouts = [ParamLayout.build(p.shape, world, rank) for _, p, _ in entries]
        self.layout = FlatLayout.build(layouts, world)
        self.flat_shard = torch.zeros(self.layout.shard_numel, dtype=dtype, device=device)
        self.params: list[ShardedParam] = []
        with torch.no_grad():
            for (fqn, original, locations), pl, offset in zip(entries, layouts, self.layout.offsets, strict=True):
                piece = self.flat_shard[offset : offset + pl.local_numel].view(pl.local_shape)
                if device.type != "meta" and pl.local_rows:
                    piece.copy_(self.local_rows(pl, original.detach()))
                sharded = nn.Parameter(alias(piece), requires_grad=original.requires_grad)
                sp = ShardedParam(fqn=fqn, locations=locations, layout=pl, sharded=sharded)
                sp.register(sharded)
                self.params.append(sp)
        self._offsets = {id(sp): off for sp, off in zip(self.params, self.layout.offsets, strict=True)}
        self._unsharded_flat: torch.Tensor | None = None
        self._pending_gather: PendingGather | None = None
        self._grad_layouts: dict[tuple[bool, ...], FlatLayout] = {}

    # ------------------------------------------------------------------ registration
    def register_sharded(self) -> None:
        for sp in self.params:
            sp.register(sp.sharded)

    def register_unsharded(self) -> None:
        for sp in self.params:
            sp.register(sp.unsharded)

    # ------------------------------------------------------------------ gather / free
    @property
    def gathering(self) -> bool:
        """Whether an asynchronous all-gather of this group is in flight."""
        return self._pending_gather is not None

    def unshard(self, *, comm: Comm, memory: MemoryTracker, name: str, phase: str) -> None:
        """Gather full parameters (compute dtype) into the gathered buffer; finishes a started prefetch."""
        if self.aliased:
            self.check_shards_in_place(name)
            flat = self.flat_shard
        else:
            flat = self._alloc_unsharded_flat(memory)
            if self.mesh.shard_size == 1:
                self.check_shards_in_place(name)
                flat.copy_(self.flat_shard)  # a cast only
            else:
                pending, self._pending_gather = self._pending_gather, None
                if pending is None:
                    pending = self._start_all_gather(
                        self.compute_dtype, comm=comm, memory=memory, name=name, phase=phase, async_op=False
                    )
                self._finish_all_gather(pending, flat, memory)
        if self.params[0].unsharded is None:
            with torch.inference_mode(False):  # see _alloc_unsharded_flat
                for sp, offset in zip(self.params, self.layout.unsharded_offsets, strict=True):
                    full = alias(flat)[offset : offset + sp.layout.numel].view(sp.layout.shape)
                    sp.unsharded = nn.Parameter(full, requires_grad=sp.sharded.requires_grad)
                    setattr(sp.unsharded, GATHERED_ATTR, sp.fqn)

    def prefetch(self, *, comm: Comm, memory: MemoryTracker, name: str, phase: str) -> bool:
        """Start gathering asynchronously; False when there is nothing to communicate or it already started."""
        if self._pending_gather is not None or self.mesh.shard_size == 1:
            return False
        self._pending_gather = self._start_all_gather(
            self.compute_dtype, comm=comm, memory=memory, name=name, phase=phase, async_op=True
        )
        return True

    def cancel_prefetch(self, memory: MemoryTracker) -> None:
        """Drop a gather that was started but will not be used (it completes first: collectives must)."""
        pending, self._pending_gather = self._pending_gather, None
        if pending is not None:
            pending.wait()
            memory.add("comm_buffers", -pending.buffer_bytes)

    def free_unsharded(self, memory: MemoryTracker) -> None:
        """Register the shards again and free the gathered buffer's memory (the tensors stay, empty)."""
        self.register_sharded()
        flat = self._unsharded_flat
        if flat is not None and flat.untyped_storage().nbytes():
            storage = flat.untyped_storage()
            memory.add("unsharded_params", -storage.nbytes())
            storage.resize_(0)

    def _alloc_unsharded_flat(self, memory: MemoryTracker) -> torch.Tensor:
        flat = self._unsharded_flat
        if flat is None:
            # Note: the gathered buffer and parameters live for the whole run and are refilled in
            # place; created under torch.inference_mode() (a first evaluation) they would be
            # inference tensors that no later training gather may write into.
            with torch.inference_mode(False):
                flat = torch.empty(self.layout.unsharded_numel, dtype=self.compute_dtype, device=self.device)
            self._unsharded_flat = flat
        elif flat.untyped_storage().nbytes() == 0:
            flat.untyped_storage().resize_(nbytes(flat))
        else:
            return flat  # still allocated (counted already)
        memory.add("unsharded_params", nbytes(flat))
        return flat

    def _start_all_gather(
        self, dtype: torch.dtype, *, comm: Comm, memory: MemoryTracker | None, name: str, phase: str, async_op: bool
    ) -> PendingGather:
        """Issue the all-gather of the shards (cast to ``dtype``) into a rank-major buffer."""
        self.check_shards_in_place(name)
        world = self.mesh.shard_size
        send = self.flat_shard if dtype == self.dtype else self.flat_shard.to(dtype)
        gathered = torch.empty(world * self.layout.shard_numel, dtype=dtype, device=self.device)
        buffers = nbytes(gathered) + (nbytes(send) if send is not self.flat_shard else 0)
        if memory is not None:
            memory.add("comm_buffers", buffers)
        with label(f"all_gather {name}"):
            work = comm.all_gather(gathered, send, self.mesh.shard_group, unit=name, phase=phase, async_op=async_op)
        return PendingGather(work, gathered, send, buffers if memory is not None else 0)

    def _finish_all_gather(self, pending: PendingGather, flat: torch.Tensor, memory: MemoryTracker | None) -> None:
        """Wait for ``pending`` and copy it out into the parameter-major buffer ``flat``."""
        pending.wait()
        layout, world = self.layout, self.mesh.shard_size
        # Copy-out: column block i of the (world, S) view is parameter i's padded rows in order.
        outs = [
            flat[offset : offset + world * pl.padded_numel].view(world, pl.padded_numel)
            for pl, offset in zip(layout.params, layout.unsharded_offsets, strict=True)
        ]
        with label("copy_out"):
            torch.split_with_sizes_copy(pending.gathered.view(world, -1), layout.padded_sizes, dim=1, out=outs)
        if memory is not None:
            memory.add("comm_buffers", -pending.buffer_bytes)

    # ------------------------------------------------------------------ shards moved by the user
    def check_shards_in_place(self, name: str = "") -> None:
        """Re-adopt shards whose ``.data`` was replaced (e.g. ``param.data = t``) into the flat buffer.

        Runs before every gather, so it only compares addresses and does real work only for a
        shard that moved.
        """
        base, size = self.flat_shard.data_ptr(), self.flat_shard.element_size()
        for sp, offset in zip(self.params, self.layout.offsets, strict=True):
            if not sp.layout.local_numel or sp.sharded.data_ptr() == base + offset * size:
                continue
            data = sp.sharded.data
            if data.shape != sp.layout.local_shape or data.dtype != self.dtype or data.device != self.device:
                raise ShardingError(
                    f"the shard of parameter '{sp.fqn}' in unit {name!r} was replaced by a tensor of shape "
                    f"{tuple(data.shape)}, dtype {data.dtype}, device {data.device}; expected shape "
                    f"{sp.layout.local_shape}, {self.dtype} on {self.device}. Move or cast the model before calling "
                    "fully_shard, not after."
                )
            piece = self.flat_shard[offset : offset + sp.layout.local_numel]
            with torch.no_grad():
                piece.copy_(data.reshape(-1))
            sp.sharded.data = alias(piece).view(sp.layout.local_shape)

    # ------------------------------------------------------------------ gradients
    def trainable(self) -> list[ShardedParam]:
        return [sp for sp in self.params if sp.sharded.requires_grad]

    def _grad_layout(self, params: list[ShardedParam]) -> FlatLayout:
        """Flat layout of the trainable parameters (frozen ones send no gradient bytes)."""
        key = tuple(sp.sharded.requires_grad for sp in self.params)
        layout = self._grad_layouts.get(key)
        if layout is None:
            layout = FlatLayout.build([sp.layout for sp in params], self.mesh.shard_size)
            self._grad_layouts[key] = layout
        return layout

    def reduce_gradients(self, *, comm: Comm, memory: MemoryTracker, name: str) -> PendingReduce | None:
        """Pack the gathered gradients and start their reduction (asynchronously).

        Returns the pending reduction, or None when no parameter of the group has a gradient.
        Parameters without a gradient on this rank contribute zeros when others have one.
        """
        params = self.trainable()
        grads = [sp.unsharded_grad() for sp in params]
        if all(g is None for g in grads):
            return None
        for sp in params:
            sp.clear_unsharded_grad()
        layout = self._grad_layout(params)
        dtype, world = self.reduce_dtype, self.mesh.shard_size
        if world == 1 and self.mesh.replicate_size == 1 and all(g is None or g.is_contiguous() for g in grads):
            # One rank and no replicas: nothing to reduce or pack; hand the gradients over as they
            # are (same values as averaging over one rank, bit for bit). Missing ones stay None.
            return PendingReduce(self, name, memory, None, None, params, layout, direct=grads)
        packed = None
        if world > 1:
            packed = self.pack_rows(grads, layout, dtype)
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
                output = self.pack_rows(grads, layout, dtype).view(-1)
            work = None
        if self.mesh.replicate_size > 1:
            work = comm.all_reduce(
                output, self.mesh.replicate_group, op=dist.ReduceOp.AVG, unit=name, phase="backward", async_op=True
            )
        fresh_output = all(_ptr(output) != _ptr(g) for g in grads)
        held = (nbytes(packed) if packed is not None else 0) + (nbytes(output) if fresh_output else 0)
        memory.add("comm_buffers", held)
        return PendingReduce(self, name, memory, work, output, params, layout, packed=packed, buffer_bytes=held)

    def accumulate_unsynced(self) -> None:
        """Under ``no_sync``: keep gradients unreduced; widen them to the reduce dtype if it is wider."""
        for sp in self.trainable():
            grad = sp.unsharded.grad if sp.unsharded is not None else None
            if grad is None or grad.dtype == self.reduce_dtype:
                continue
            if sp.accumulated_grad is None:
                sp.accumulated_grad = grad.to(self.reduce_dtype)
            else:
                sp.accumulated_grad.add_(grad)
            sp.unsharded.grad = None

    # ------------------------------------------------------------------ packing (the one owner)
    def pack_rows(self, fulls: Sequence[torch.Tensor | None], layout: FlatLayout, dtype: torch.dtype) -> torch.Tensor:
        """Full tensors as ``(world, S)``: each one's rows zero-padded to ``world * chunk``, rank-major blocks.

        ``layout`` describes ``fulls`` (the group's layout, or the trainable subset's for
        gradients); ``None`` entries contribute zeros.
        """
        world = layout.world
        out = torch.empty(world, layout.shard_numel, dtype=dtype, device=self.device)
        blocks = []
        for full, pl in zip(fulls, layout.params, strict=True):
            if full is None:
                blocks.append(torch.zeros(world, pl.padded_numel, dtype=dtype, device=self.device))
                continue
            rows = full.reshape(pl.rows, pl.row_numel)
            if rows.dtype != dtype:
                rows = rows.to(dtype)
            pad = world * pl.chunk - pl.rows
            if pad:
                rows = F.pad(rows, (0, 0, 0, pad))
            blocks.append(rows.view(world, pl.padded_numel))
        torch.cat(blocks, dim=1, out=out)
        return out

    @staticmethod
    def local_rows(pl: ParamLayout, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the full tensor ``full`` (a view when ``full`` is contiguous), shaped like the shard."""
        rows = full.reshape(pl.rows, *pl.row_shape)[pl.row_start : pl.row_start + pl.local_rows]
        return rows.reshape(pl.local_shape)

    @torch.no_grad()
    def load_full(self, sp: ShardedParam, full: torch.Tensor) -> None:
        """Copy this rank's rows of ``full`` into ``sp``'s shard."""
        pl = sp.layout
        if not pl.local_rows:
            return
        offset = self._offsets[id(sp)]
        self.flat_shard[offset : offset + pl.local_numel].view(pl.local_shape).copy_(self.local_rows(pl, full))

    def gather_full(
        self,
        tensors: Sequence[torch.Tensor | None],
        *,
        dtype: torch.dtype,
        comm: Comm,
        name: str,
        phase: str,
    ) -> list[torch.Tensor | None]:
        """All-gather shard-shaped tensors, one per parameter of the group (``None``: skip), to full tensors.

        A collective over the shard group (one all-gather of the packed buffer). Used for the
        parameters themselves and for elementwise optimizer state. Returns new tensors in ``dtype``
        (each parameter's own shape, ``()`` for 0-d ones).
        """
        layout, world = self.layout, self.mesh.shard_size
        flat = torch.zeros(layout.shard_numel, dtype=dtype, device=self.device)
        for t, sp, off in zip(tensors, self.params, layout.offsets, strict=True):
            if t is not None and sp.layout.local_numel:
                flat[off : off + sp.layout.local_numel].copy_(t.reshape(-1))
        if world > 1:
            gathered = torch.empty(world * layout.shard_numel, dtype=dtype, device=self.device)
            comm.all_gather(gathered, flat, self.mesh.shard_group, unit=name, phase=phase)
            rows = gathered.view(world, layout.shard_numel)
        else:
            rows = flat.view(1, layout.shard_numel)
        out: list[torch.Tensor | None] = []
        for t, sp, off in zip(tensors, self.params, layout.offsets, strict=True):
            if t is None:
                out.append(None)
                continue
            pl = sp.layout
            block = rows[:, off : off + pl.padded_numel].reshape(world * pl.chunk, *pl.row_shape)
            out.append(block[: pl.rows].clone().reshape(pl.shape))
        return out

    def scatter_from_rank0(
        self, fulls: Sequence[torch.Tensor] | None, *, is_source: bool, comm: Comm, name: str, phase: str
    ) -> None:
        """The source rank packs the full tensors rank-major; every rank receives its flat shard."""
        source = self.pack_rows(fulls, self.layout, self.dtype) if is_source and fulls is not None else None
        if self.mesh.shard_size > 1:
            chunks = list(source.unbind(0)) if source is not None else None
            comm.scatter(self.flat_shard, chunks, self.mesh.shard_group, unit=name, phase=phase)
        else:
            if source is not None:
                self.flat_shard.copy_(source.view(-1))
            if self.mesh.replicate_size > 1:
                comm.broadcast(self.flat_shard, self.mesh.replicate_group, unit=name, phase=phase)

    def to_dtensor(self, sp: ShardedParam, local: torch.Tensor | None = None) -> DTensor:
        """``local`` (default: ``sp``'s shard) as a DTensor piece of ``sp``'s global shape, sharing its memory.

        ``Shard(0)`` over the shard group for sharded groups, ``Replicate()`` for NO_SHARD.
        0-d parameters appear with shape ``(1,)``.
        """
        local = sp.sharded.detach() if local is None else local
        if tuple(local.shape) != sp.layout.local_shape:
            raise ShardingError(
                f"a tensor of shape {tuple(local.shape)} cannot be placed like parameter '{sp.fqn}', whose local "
                f"shard has shape {sp.layout.local_shape}"
            )
        shape = sp.global_shape
        placement = Shard(0) if self.mesh.shard_size > 1 else Replicate()
        return DTensor.from_local(
            local,
            self.mesh.device_mesh_for(local.device.type),
            [placement],
            run_check=False,
            shape=torch.Size(shape),
            stride=_contiguous_stride(shape),
        )

    # ------------------------------------------------------------------ deferred init
    def materialize(self, device: torch.device) -> None:
        """Give a group built on the meta device real (zeroed) shard storage on ``device``."""
        self.flat_shard = torch.zeros(self.layout.shard_numel, dtype=self.dtype, device=device)
        self.device = device
        self._unsharded_flat = None  # gathered parameters are recreated on the new device
        self._offsets = {id(sp): off for sp, off in zip(self.params, self.layout.offsets, strict=True)}
        for sp, offset in zip(self.params, self.layout.offsets, strict=True):
            sp.unsharded, sp.hooked = None, False
            piece = self.flat_shard[offset : offset + sp.layout.local_numel].view(sp.layout.local_shape)
            fresh = nn.Parameter(alias(piece), requires_grad=sp.sharded.requires_grad)
            fresh.__dict__.update(sp.sharded.__dict__)  # swap_tensors swaps Python attributes too
            torch.utils.swap_tensors(sp.sharded, fresh)  # keeps the Parameter object optimizers hold
