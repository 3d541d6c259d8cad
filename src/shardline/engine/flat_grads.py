"""How a :class:`~shardline.engine.flat.FlatGroup` packs and reduces its gradients.

Part of ``FlatGroup`` (it inherits this class), kept in its own module for length: the group
stays the one owner of every packing. Gradients use the group's packing over its *trainable*
parameters only, so frozen ones send no bytes:

* sharded groups reduce-scatter the rank-major packed gradients over the shard group (the
  output on each rank is exactly its rows of each gradient, shaped like its shards) and, with
  replicas, all-reduce that output across them once the reduce-scatter landed (a chained
  reduction: nothing else waits for it, see ``engine/pending.py``) -- or, while the all-reduce is deferred
  (``no_sync(reduce_scatter=True)``), add it to a partial sum the next synchronized reduction
  adds in first;
* NO_SHARD all-reduces the gradients whole and copies the result back into them;
* SHARD_OPT all-reduces them whole; each rank's ``.grad`` is its rows of the result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardline.engine.layout import FlatLayout, ParamLayout
from shardline.engine.memory import MemoryTracker, nbytes
from shardline.engine.param import ShardedParam
from shardline.engine.pending import GradSlice, PendingReduce

if TYPE_CHECKING:
    from shardline.engine.comm import Comm, Work
    from shardline.engine.mesh import ShardMesh
    from shardline.engine.offload import HostCopies

__all__ = ["GradientReduction"]


class GradientReduction:
    """The gradient half of :class:`~shardline.engine.flat.FlatGroup` (see the module docstring)."""

    # Set by FlatGroup.__init__.
    dtype: torch.dtype
    reduce_dtype: torch.dtype
    mesh: ShardMesh
    device: torch.device
    replicated: bool
    offload: HostCopies | None
    params: list[ShardedParam]
    partial: torch.Tensor | None
    _dirty: bool
    _grad_layouts: dict[tuple[int, ...], FlatLayout]

    def trainable(self) -> list[ShardedParam]:
        return [sp for sp in self.params if sp.sharded.requires_grad]

    def _grad_layout(self, params: list[ShardedParam], world: int) -> FlatLayout:
        """Flat layout of the trainable parameters over ``world`` ranks (frozen ones send no gradient bytes)."""
        key = (world, *(sp.sharded.requires_grad for sp in self.params))
        layout = self._grad_layouts.get(key)
        if layout is None:
            if world > 1:  # the shards' own layouts: this rank's rows
                layout = FlatLayout.build([sp.layout for sp in params], world)
            else:  # whole gradients, one after the other
                layout = FlatLayout.build([ParamLayout.build(sp.layout.shape, 1, 0) for sp in params], 1)
            self._grad_layouts[key] = layout
        return layout

    def _slices(self, params: list[ShardedParam], layout: FlatLayout) -> list[GradSlice]:
        """Where each parameter's gradient rows sit in the reduction output laid out by ``layout``."""
        out = []
        for sp, _pl, offset in zip(params, layout.params, layout.offsets, strict=True):
            start = offset + (sp.layout.row_start * sp.layout.row_numel if layout.world == 1 else 0)
            out.append(GradSlice(sp, start, sp.layout.local_numel, sp.layout.local_shape))
        return out

    def reduce_gradients(
        self, *, comm: Comm, memory: MemoryTracker, name: str, all_reduce: bool = True
    ) -> PendingReduce | None:
        """Start the reduction of the gathered gradients (see :meth:`_reduce`); offloaded, it lands on the host."""
        pending = self._reduce(comm=comm, memory=memory, name=name, all_reduce=all_reduce)
        if pending is not None and self.offload is not None:
            pending.to_host = self.offload.to_host
        return pending

    def _reduce(self, *, comm: Comm, memory: MemoryTracker, name: str, all_reduce: bool = True) -> PendingReduce | None:
        """Pack the gathered gradients and start their reduction (asynchronously).

        Sharded groups reduce-scatter over the shard group and then, with replicas, all-reduce
        across them -- unless ``all_reduce`` is False: then the reduce-scattered gradients are
        added to :attr:`partial`, which the next synchronized reduction adds in before its
        all-reduce. Replicated groups all-reduce the full gradients. Returns the pending
        reduction, or None when no parameter of the group has a gradient (and nothing is
        pending). Parameters without a gradient on this rank contribute zeros when others have one.
        """
        params = self.trainable()
        grads = [sp.unsharded_grad() for sp in params]
        if all(g is None for g in grads) and self.partial is None:
            return None
        for sp in params:
            sp.clear_unsharded_grad()
        # Replicated groups: an optimizer step follows a reduction; gather its updates before the next
        # forward. A reduction is a collective, so every rank decides alike.
        self._dirty = self.replicated
        dtype, world = self.reduce_dtype, self.mesh.shard_size
        scatter = world > 1 and not self.replicated
        layout = self._grad_layout(params, world if scatter else 1)
        slices = self._slices(params, layout)
        replicas = self.mesh.replicate_size > 1 and all_reduce
        if world == 1 and not replicas and all(g is None or g.is_contiguous() for g in grads):
            # One rank and no replicas: nothing to reduce or pack; hand the gradients over as they
            # are (same values as averaging over one rank, bit for bit). Missing ones stay None.
            return PendingReduce(name, memory, self.dtype, None, None, slices, direct=grads)
        work = None
        if scatter:
            # The packed gradients are scratch: the memory tracker's spare buffer, reused unit after unit.
            packed = memory.take(world * layout.shard_numel, dtype, self.device).view(world, layout.shard_numel)
            self.pack_rows(grads, layout, dtype, out=packed)
            output = torch.empty(layout.shard_numel, dtype=dtype, device=self.device)
            memory.add("comm_buffers", nbytes(output))
            assert self.mesh.shard_group is not None  # scatter: split over ranks
            work = comm.reduce_scatter(
                output, packed.view(-1), self.mesh.shard_group, op=dist.ReduceOp.AVG,
                unit=name, phase="backward", async_op=True,
            )  # fmt: skip
            if not all_reduce and self.mesh.replicate_size > 1:
                return PendingReduce(
                    name, memory, self.dtype, work, output, slices,
                    spare=packed, buffer_bytes=nbytes(output), into_partial=self,
                )  # fmt: skip
            if self.mesh.replicate_size > 1:
                # The all-reduce across replicas waits for the reduce-scatter; the caller does not
                # (see the note on chained reductions in engine/pending.py).
                return PendingReduce(
                    name, memory, self.dtype, work, output, slices, spare=packed, buffer_bytes=nbytes(output),
                    then=self._cross_replica(output, self.partial, comm, name),
                )  # fmt: skip
            held, spare, back = nbytes(output), packed, None
        elif len(grads) == 1 and grads[0] is not None and grads[0].dtype == dtype and grads[0].is_contiguous():
            output = grads[0].view(-1)  # the gradient itself: no copy, nothing new allocated
            held, spare, back = 0, None, None
        elif not self.replicated and all(
            g is None or (g.dtype == dtype == self.dtype and g.is_contiguous()) for g in grads
        ):
            # Note: NO_SHARD reduces in the spare buffer and copies the result back into the gradients
            # autograd allocated, which become the ``.grad`` -- a copy of warm memory instead of a fresh
            # buffer the size of the unit's gradients every step.
            output = memory.take(layout.shard_numel, dtype, self.device)
            self.pack_rows(grads, layout, dtype, out=output.view(1, -1))
            held, spare, back = 0, output, grads
        else:  # SHARD_OPT (its ``.grad`` are rows of the whole reduced gradients), or casts
            output = self.pack_rows(grads, layout, dtype).view(-1)
            held, spare, back = nbytes(output), None, None
            memory.add("comm_buffers", held)
        reduce_group = self.mesh.shard_group if self.replicated else self.mesh.replicate_group
        if (self.replicated and world > 1) or replicas:
            assert reduce_group is not None  # a shard group of several ranks, or replicas
            work = comm.all_reduce(
                output, reduce_group, op=dist.ReduceOp.AVG, unit=name, phase="backward", async_op=True
            )
        return PendingReduce(
            name, memory, self.dtype, work, output, slices, spare=spare, buffer_bytes=held, copy_back=back
        )

    def _cross_replica(
        self, output: torch.Tensor, partial: torch.Tensor | None, comm: Comm, name: str
    ) -> Callable[[], Work | None]:
        """The second stage of a hybrid reduction: add the deferred partial sum, all-reduce across replicas."""
        self.partial = None  # this reduction carries it

        replicate_group = self.mesh.replicate_group
        assert replicate_group is not None  # called for hybrid reductions only

        def issue() -> Work | None:
            if partial is not None:
                output.add_(partial)
            return comm.all_reduce(
                output, replicate_group, op=dist.ReduceOp.AVG, unit=name, phase="backward", async_op=True
            )

        return issue

    def add_partial(self, reduced: torch.Tensor) -> None:
        """Add reduce-scattered gradients to the partial sum awaiting the all-reduce across replicas."""
        if self.partial is None:
            self.partial = reduced
        else:
            self.partial += reduced

    def accumulate_unsynced(self) -> None:
        """Under ``no_sync``: keep gradients unreduced; widen them to the reduce dtype if it is wider."""
        for sp in self.trainable():
            grad = sp.unsharded.grad if sp.unsharded is not None else None
            if grad is None or grad.dtype == self.reduce_dtype:
                continue
            assert sp.unsharded is not None  # it has a gradient
            if sp.accumulated_grad is None:
                sp.accumulated_grad = grad.to(self.reduce_dtype)
            else:
                sp.accumulated_grad.add_(grad)
            sp.unsharded.grad = None

    def pack_rows(
        self,
        fulls: Sequence[torch.Tensor | None],
        layout: FlatLayout,
        dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Full tensors as ``(world, S)``: each one's rows zero-padded to ``world * chunk``, rank-major blocks.

        ``layout`` describes ``fulls`` (the group's layout, or the trainable subset's for
        gradients); ``None`` entries contribute zeros. Written into ``out`` when given.
        """
        world = layout.world
        if out is None:
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
