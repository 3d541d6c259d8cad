"""The parameters of a unit that share a dtype, in one master buffer per rank, and every way data moves through it.

This is the only place that knows how parameters are packed (see the note in
:mod:`shardline.engine.layout`): gathering parameters, packing gradients for their
reduction, gathering any shard-shaped tensors (parameters, optimizer state) to full ones,
slicing a full tensor to this rank's rows, scattering from rank 0, and viewing a shard as a
DTensor. The unit decides *when* these happen; the engine's hooks decide *why*. The gradient
half of the class lives in :mod:`shardline.engine.flat_grads` (``FlatGroup`` inherits it).

Note: why one group per dtype. A LoRA model keeps its frozen base in bf16 and its adapters in
fp32, often inside one decoder layer. Collectives move one dtype at a time, so a unit keeps one
:class:`FlatGroup` per master dtype; each has its own all-gather and (if any of its parameters
train) its own reduction, and the unit drives them together.

Note: the master buffer (``master``), in the two ways a group keeps its parameters.

* **sharded** (FULL_SHARD, SHARD_GRAD_OP, hybrid; NO_SHARD as a shard group of one): the
  flat shard -- this rank's piece of each parameter, zero-padded to ``chunk`` rows, at the
  same offset on every rank. The all-gather sends it as is and copies the result out into a
  parameter-major gathered buffer, freed after use.
* **replicated** (SHARD_OPT / ZeRO-1): the full parameters, parameter-major, kept on every
  rank. The parameter the optimizer sees is a view of this rank's rows of each one, so the
  optimizer updates the full parameters in place and its state is sharded; gradients are
  all-reduced and each rank's ``.grad`` is its rows of the result. Before the next forward,
  if any shard changed (autograd's version counter, or an engine write), every rank sends its
  rows packed like a flat shard and copies the all-gather out into its full parameters:
  ``(W-1)/W`` of the parameter bytes, on top of the gradients' ``2(W-1)/W``. Nothing else is
  held: parameters ``4P``, gradients ``4P``, AdamW state ``8P/W`` (fp32).

Note: partial resharding (``reshard_after_forward=N``). After forward, instead of freeing the
gathered parameters down to the flat shard, a group packs this rank's piece of them split over
its post-forward group of ``N`` ranks (``FlatLayout`` over ``N``, compute dtype) and frees the
rest. Backward's all-gather then runs over those ``N`` ranks and copies out into the same
gathered buffer; the values are the very elements forward used, so numerics do not change.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from shardline import _torch_compat
from shardline.engine.comm import Comm
from shardline.engine.flat_grads import GradientReduction
from shardline.engine.layout import FlatLayout, ParamLayout, contiguous_stride
from shardline.engine.memory import MemoryTracker, nbytes
from shardline.engine.mesh import ShardMesh, post_forward_group
from shardline.engine.offload import HostCopies
from shardline.engine.param import GATHERED_ATTR, ShardedParam, alias
from shardline.engine.pending import PendingGather
from shardline.engine.profiling import label
from shardline.errors import ShardingError

__all__ = ["FlatGroup", "flat_group"]


class _PostShard:
    """This rank's piece of the gathered parameters, split over its post-forward group."""

    __slots__ = ("buffer", "group", "layout")

    def __init__(self, buffer: torch.Tensor, layout: FlatLayout, group: dist.ProcessGroup) -> None:
        self.buffer, self.layout, self.group = buffer, layout, group


class FlatGroup(GradientReduction):
    """The parameters of one unit that share a master dtype, in one master buffer per rank.

    The ``nn.Parameter`` objects registered on the modules between steps are views into
    ``master`` (this rank's rows), so an optimizer updates the buffer in place and the next
    all-gather sends it without a copy-in (see the module notes for the replicated case).
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
        replicated: bool = False,
        offload: HostCopies | None = None,
    ) -> None:
        self.dtype = dtype
        self.compute_dtype = compute_dtype
        self.reduce_dtype = reduce_dtype
        self.mesh = mesh
        self.device = device
        self.replicated = replicated
        self.offload = offload  # CPU offload: the master buffer lives in host memory (see engine/offload.py)
        world, rank = mesh.shard_size, mesh.shard_rank
        # Gathered parameters can alias the master buffer itself when it holds full parameters uncast
        # (never when it lives on the host: the gathered parameters must be on the device).
        self.aliased = compute_dtype == dtype and (replicated or world == 1) and offload is None
        layouts = [ParamLayout.build(p.shape, world, rank) for _, p, _ in entries]
        self.layout = FlatLayout.build(layouts, world)
        self._piece_offsets = self._compute_piece_offsets()
        self.master = self._new_master(device)
        self.params: list[ShardedParam] = []
        with torch.no_grad():
            for i, ((fqn, original, locations), pl) in enumerate(zip(entries, layouts, strict=True)):
                piece = self._piece(i)
                if device.type != "meta":
                    if replicated:
                        self._slot(i).copy_(original.detach().reshape(-1))
                    elif pl.local_rows:
                        piece.copy_(self.local_rows(pl, original.detach()))
                sharded = nn.Parameter(alias(piece), requires_grad=original.requires_grad)
                sp = ShardedParam(fqn=fqn, locations=locations, layout=pl, sharded=sharded)
                sp.register(sharded)
                self.params.append(sp)
        self._index = {id(sp): i for i, sp in enumerate(self.params)}
        self._unsharded_flat: torch.Tensor | None = None
        self._pending_gather: PendingGather | None = None
        self._grad_layouts: dict[tuple[int, ...], FlatLayout] = {}  # (world, trainable flags...)
        self._post: _PostShard | None = None
        self._post_layouts: dict[int, tuple[dist.ProcessGroup, FlatLayout]] = {}
        self.partial: torch.Tensor | None = None  # reduce-scattered gradients awaiting the replica all-reduce
        self._versions = self._current_versions()
        self._dirty = False  # replicated: this rank's rows were written by the engine since the last gather

    # ------------------------------------------------------------------ where each piece lives
    @property
    def _master_numel(self) -> int:
        return self.layout.unsharded_numel if self.replicated else self.layout.shard_numel

    def _compute_piece_offsets(self) -> list[int]:
        if not self.replicated:
            return list(self.layout.offsets)
        return [
            off + pl.row_start * pl.row_numel
            for pl, off in zip(self.layout.params, self.layout.unsharded_offsets, strict=True)
        ]

    def _new_master(self, device: torch.device) -> torch.Tensor:
        """A zeroed master buffer: on the host when offloaded (unless building on the meta device)."""
        if self.offload is not None and device.type != "meta":
            return self.offload.host_zeros(self._master_numel, self.dtype)
        return torch.zeros(self._master_numel, dtype=self.dtype, device=device)

    def _piece(self, i: int, flat: torch.Tensor | None = None) -> torch.Tensor:
        """Parameter ``i``'s rows on this rank: a view into ``master`` (or into ``flat``, a copy of it)."""
        pl = self.layout.params[i]
        offset = self._piece_offsets[i]
        base = self.master if flat is None else flat
        return base[offset : offset + pl.local_numel].view(pl.local_shape)

    def _shard_on_device(self) -> torch.Tensor:
        """The flat shard on the compute device: ``master`` itself, or (offloaded) a fresh device copy of it."""
        if self.offload is None:
            return self.master
        return self.offload.to_device(self.master)

    def _slot(self, i: int) -> torch.Tensor:
        """Replicated groups: parameter ``i``'s full elements in ``master`` (flat)."""
        pl, offset = self.layout.params[i], self.layout.unsharded_offsets[i]
        return self.master[offset : offset + pl.numel]

    # ------------------------------------------------------------------ registration
    def register_sharded(self) -> None:
        for sp in self.params:
            sp.register(sp.sharded)

    def register_unsharded(self) -> None:
        for sp in self.params:
            assert sp.unsharded is not None  # unshard made it
            sp.register(sp.unsharded)

    # ------------------------------------------------------------------ gather / free
    @property
    def gathering(self) -> bool:
        """Whether an asynchronous all-gather of this group is in flight."""
        return self._pending_gather is not None

    @property
    def holds_post_shard(self) -> bool:
        """Whether a partial reshard left this rank's post-forward piece (backward gathers it)."""
        return self._post is not None

    def _current_versions(self) -> tuple[int, ...]:
        return tuple(_torch_compat.version_of(sp.sharded) for sp in self.params)

    def stale(self) -> bool:
        """Replicated groups: whether some rank's rows may have changed since the last all-gather."""
        return self._dirty or self._current_versions() != self._versions

    def mark_updated(self) -> None:
        """Replicated groups: the shards were (or may have been) changed outside autograd's view."""
        self._dirty = True

    def unshard(self, *, comm: Comm, memory: MemoryTracker, name: str, phase: str) -> None:
        """Gather full parameters (compute dtype) into the gathered buffer; finishes a started prefetch."""
        self.check_shards_in_place(name)
        if self.replicated:
            self._sync_replicas(comm=comm, memory=memory, name=name, phase=phase)
            flat = self.master
            if not self.aliased:
                flat = self._alloc_unsharded_flat(memory)
                flat.copy_(self.master)  # a cast only
        elif self.aliased:
            flat = self.master
        elif self.mesh.shard_size == 1:
            flat = self._alloc_unsharded_flat(memory)
            if self.offload is not None and flat.dtype == self.dtype:
                self.offload.to_device(self.master, out=flat)  # the host -> device copy is the gather
            else:
                flat.copy_(self._shard_on_device())  # a cast only (offloaded: a copy to the device first)
        else:
            pending, self._pending_gather = self._pending_gather, None
            if pending is None or not pending.in_place:  # an in-place prefetch allocated it already
                self._alloc_unsharded_flat(memory)
            if pending is None:
                pending = self._start_all_gather(comm=comm, memory=memory, name=name, phase=phase, async_op=False)
            gathered = self._unsharded_flat
            assert gathered is not None
            self._finish_all_gather(pending, gathered, memory)
            flat = gathered
        self._drop_post_shard(memory)
        if self.params[0].unsharded is None:
            with torch.inference_mode(False):  # see _alloc_unsharded_flat
                for sp, offset in zip(self.params, self.layout.unsharded_offsets, strict=True):
                    full = alias(flat)[offset : offset + sp.layout.numel].view(sp.layout.shape)
                    sp.unsharded = nn.Parameter(full, requires_grad=sp.sharded.requires_grad)
                    setattr(sp.unsharded, GATHERED_ATTR, sp.fqn)

    def _sync_replicas(self, *, comm: Comm, memory: MemoryTracker, name: str, phase: str) -> None:
        """Replicated groups: all-gather every rank's updated rows into the full parameters, if any changed."""
        pending, self._pending_gather = self._pending_gather, None
        if pending is None:
            if self.mesh.shard_size == 1 or not self.stale():
                return
            pending = self._start_all_gather(comm=comm, memory=memory, name=name, phase=phase, async_op=False)
        self._finish_all_gather(pending, self.master, memory)
        self._versions = self._current_versions()
        self._dirty = False

    def prefetch(self, *, comm: Comm, memory: MemoryTracker, name: str, phase: str) -> bool:
        """Start gathering asynchronously; False when there is nothing to communicate or it already started."""
        if self._pending_gather is not None or self.mesh.shard_size == 1:
            return False
        self.check_shards_in_place(name)
        if self.replicated and not self.stale():
            return False
        self._pending_gather = self._start_all_gather(comm=comm, memory=memory, name=name, phase=phase, async_op=True)
        return True

    def cancel_prefetch(self, memory: MemoryTracker) -> None:
        """Drop a gather that was started but will not be used (it completes first: collectives must)."""
        pending, self._pending_gather = self._pending_gather, None
        if pending is not None:
            pending.wait()
            memory.add("comm_buffers", -pending.buffer_bytes)
            if pending.in_place and pending.gathered is self._unsharded_flat:
                pending.gathered.untyped_storage().resize_(0)  # counted with the buffers just released

    def free_unsharded(self, memory: MemoryTracker) -> None:
        """Register the shards again and free the gathered buffer's memory (the tensors stay, empty)."""
        self.register_sharded()
        self._drop_post_shard(memory)
        flat = self._unsharded_flat
        if flat is not None and flat.untyped_storage().nbytes():
            storage = flat.untyped_storage()
            memory.add("unsharded_params", -storage.nbytes())
            storage.resize_(0)

    def reshard_partial(self, size: int, memory: MemoryTracker) -> None:
        """Keep this rank's piece of the gathered parameters split over ``size`` ranks; free the rest."""
        group, layout = self._post_layout(size)
        fulls = [sp.unsharded.detach() if sp.unsharded is not None else None for sp in self.params]
        buffer = self._pack_local(fulls, layout, self.compute_dtype)
        memory.add("unsharded_params", nbytes(buffer))
        self.free_unsharded(memory)
        self._post = _PostShard(buffer, layout, group)

    def _post_layout(self, size: int) -> tuple[dist.ProcessGroup, FlatLayout]:
        found = self._post_layouts.get(size)
        if found is None:
            group = post_forward_group(self.mesh, size)
            rank = dist.get_rank(group)
            layout = FlatLayout.build([ParamLayout.build(pl.shape, size, rank) for pl in self.layout.params], size)
            found = self._post_layouts[size] = (group, layout)
        return found

    def _drop_post_shard(self, memory: MemoryTracker) -> None:
        post, self._post = self._post, None
        if post is not None:
            memory.add("unsharded_params", -nbytes(post.buffer))

    def _alloc_unsharded_flat(self, memory: MemoryTracker, component: str = "unsharded_params") -> torch.Tensor:
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
        memory.add(component, nbytes(flat))
        return flat

    def _start_all_gather(
        self, *, comm: Comm, memory: MemoryTracker, name: str, phase: str, async_op: bool
    ) -> PendingGather:
        """Issue the all-gather that rebuilds the full parameters.

        In place, when the backend can (see :meth:`_start_in_place_gather`); otherwise into a
        rank-major buffer that :meth:`_finish_all_gather` copies out. What is sent then: the
        post-forward piece after a partial reshard (over its small group), this rank's rows packed
        from the full parameters (replicated groups, master dtype), or the flat shard (cast to the
        compute dtype).
        """
        if self._post is None:
            pending = self._start_in_place_gather(comm=comm, memory=memory, name=name, phase=phase, async_op=async_op)
            if pending is not None:
                return pending
        if self._post is not None:
            send, layout, group = self._post.buffer, self._post.layout, self._post.group
            world = layout.world
        else:
            layout, shard_group, world = self.layout, self.mesh.shard_group, self.mesh.shard_size
            assert shard_group is not None  # only a group split over ranks gathers
            group = shard_group
            if self.replicated:
                send = self._pack_local([self._slot(i) for i in range(len(self.params))], layout, self.dtype)
            elif self.compute_dtype == self.dtype:
                send = self._shard_on_device()
            else:
                send = self._shard_on_device().to(self.compute_dtype)
        gathered = torch.empty(world * layout.shard_numel, dtype=send.dtype, device=self.device)
        buffers = nbytes(gathered) + (nbytes(send) if send is not self.master and self._post is None else 0)
        memory.add("comm_buffers", buffers)
        with label(f"all_gather {name}"):
            work = comm.all_gather(gathered, send, group, unit=name, phase=phase, async_op=async_op)
        return PendingGather(work, gathered, send, buffers, layout, world, group)

    def _start_in_place_gather(
        self, *, comm: Comm, memory: MemoryTracker, name: str, phase: str, async_op: bool
    ) -> PendingGather | None:
        """Gather straight into the parameter-major buffer, when the backend combines disjoint pieces in place.

        Note: gathering in place. Each rank writes its own rows of every parameter where they
        belong in the full, parameter-major buffer (the master itself for replicated groups, the
        gathered buffer otherwise) and zeroes everything else; combining the ranks' buffers
        element by element (gloo: a bitwise-OR all-reduce, see ``engine/comm.py``) leaves every
        rank with all rows. No rank-major buffer, no copy-out. Recorded as the all-gather it
        replaces (``W * S`` elements). Returns None when the backend cannot.
        """
        world, group = self.mesh.shard_size, self.mesh.shard_group
        assert group is not None  # only a group split over ranks gathers
        numel = self.master.numel() if self.replicated else self.layout.unsharded_numel
        dtype = self.dtype if self.replicated else self.compute_dtype
        if not comm.can_gather_in_place(group, numel=numel, dtype=dtype, device=self.device):
            return None
        fresh = 0
        staged = 0
        target: torch.Tensor | None
        if self.replicated:
            target = self.master
        else:
            flat = self._unsharded_flat
            if flat is None or not flat.untyped_storage().nbytes():  # a prefetch: counted as a buffer until it lands
                fresh = nbytes(self._alloc_unsharded_flat(memory, "comm_buffers"))
            target = self._unsharded_flat
        assert target is not None
        with torch.no_grad(), label(f"fill {name}"):
            if self.replicated:  # keep this rank's rows, zero every other row
                for i, pl in enumerate(self.layout.params):
                    slot = self._slot(i)
                    start, stop = pl.row_start * pl.row_numel, (pl.row_start + pl.local_rows) * pl.row_numel
                    slot[:start].zero_()
                    slot[stop:].zero_()
            else:
                shard = self._shard_on_device()
                if shard is not self.master:  # offloaded: the staged copy lives until the fill is done
                    staged = nbytes(shard)
                    memory.add("comm_buffers", staged)
                target.zero_()
                for i, (pl, offset) in enumerate(zip(self.layout.params, self.layout.unsharded_offsets, strict=True)):
                    if pl.local_rows:
                        start = offset + pl.row_start * pl.row_numel
                        target[start : start + pl.local_numel].copy_(self._piece(i, shard).reshape(-1))
                del shard
                memory.add("comm_buffers", -staged)
        logical = world * self.layout.shard_numel * target.element_size()
        with label(f"all_gather {name}"):
            work = comm.all_gather_in_place(target, group, nbytes=logical, unit=name, phase=phase, async_op=async_op)
        return PendingGather(
            work, target, target, fresh, self.layout, world, group, in_place=True, moves_to_unsharded=fresh
        )

    def _finish_all_gather(self, pending: PendingGather, flat: torch.Tensor, memory: MemoryTracker) -> None:
        """Wait for ``pending`` and copy it out into the parameter-major buffer ``flat`` (unless it landed there)."""
        pending.wait()
        if pending.in_place:
            memory.add("comm_buffers", -pending.buffer_bytes)
            memory.add("unsharded_params", pending.moves_to_unsharded)
            return
        layout, world = pending.layout, pending.world
        # Copy-out: column block i of the (world, S) view is parameter i's padded rows in order.
        outs = [
            flat[offset : offset + world * pl.padded_numel].view(world, pl.padded_numel)
            for pl, offset in zip(layout.params, self.layout.unsharded_offsets, strict=True)
        ]
        with label("copy_out"):
            torch.split_with_sizes_copy(pending.gathered.view(world, -1), layout.padded_sizes, dim=1, out=outs)
        memory.add("comm_buffers", -pending.buffer_bytes)

    # ------------------------------------------------------------------ shards moved by the user
    def check_shards_in_place(self, name: str = "") -> None:
        """Re-adopt shards whose ``.data`` was replaced (e.g. ``param.data = t``) into the master buffer.

        Runs before every gather, so it only compares addresses and does real work only for a
        shard that moved.
        """
        base, size = self.master.data_ptr(), self.master.element_size()
        for i, (sp, offset) in enumerate(zip(self.params, self._piece_offsets, strict=True)):
            if not sp.layout.local_numel or sp.sharded.data_ptr() == base + offset * size:
                continue
            data = sp.sharded.data
            if data.shape != sp.layout.local_shape or data.dtype != self.dtype or data.device != self.master.device:
                raise ShardingError(
                    f"the shard of parameter '{sp.fqn}' in unit {name!r} was replaced by a tensor of shape "
                    f"{tuple(data.shape)}, dtype {data.dtype}, device {data.device}; expected shape "
                    f"{sp.layout.local_shape}, {self.dtype} on {self.master.device}. Move or cast the model before "
                    "calling fully_shard, not after."
                )
            piece = self._piece(i)
            with torch.no_grad():
                piece.copy_(data)
            sp.sharded.data = alias(piece)
            self._dirty = True

    # ------------------------------------------------------------------ packing (the one owner)
    def _pack_local(self, fulls: Sequence[torch.Tensor | None], layout: FlatLayout, dtype: torch.dtype) -> torch.Tensor:
        """This rank's rows (per ``layout``) of each full tensor, packed like a flat shard (padding zeroed)."""
        out = torch.empty(layout.shard_numel, dtype=dtype, device=self.device)
        for full, pl, offset in zip(fulls, layout.params, layout.offsets, strict=True):
            piece = out[offset : offset + pl.padded_numel]
            if full is None or not pl.local_rows:
                piece.zero_()
                continue
            rows = full.reshape(pl.rows, pl.row_numel)[pl.row_start : pl.row_start + pl.local_rows]
            piece[: pl.local_numel].view(pl.local_rows, pl.row_numel).copy_(rows)
            piece[pl.local_numel :].zero_()
        return out

    @staticmethod
    def local_rows(pl: ParamLayout, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the full tensor ``full`` (a view when ``full`` is contiguous), shaped like the shard."""
        rows = full.reshape(pl.rows, *pl.row_shape)[pl.row_start : pl.row_start + pl.local_rows]
        return rows.reshape(pl.local_shape)

    @torch.no_grad()
    def load_full(self, sp: ShardedParam, full: torch.Tensor) -> None:
        """Copy ``full`` into ``sp``: this rank's rows (replicated groups: all of it)."""
        i = self._index[id(sp)]
        if self.replicated:
            self._slot(i).copy_(full.reshape(-1))
        elif sp.layout.local_rows:
            self._piece(i).copy_(self.local_rows(sp.layout, full))

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
            assert self.mesh.shard_group is not None  # world > 1
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
        """Global rank 0 gives the full tensors; every rank receives what it keeps of them.

        Sharded groups: the shard group holding rank 0 scatters its flat shards, then (hybrid)
        each replica group broadcasts from that group's member. Replicated groups: a broadcast.
        """
        mesh = self.mesh
        # Offloaded: collectives run on a device buffer, copied into the host master at the end.
        recv = self.master if self.offload is None else torch.empty_like(self.master, device=self.device)
        if self.replicated or mesh.shard_size == 1:
            if is_source and fulls is not None:
                if self.replicated:
                    for i, full in enumerate(fulls):
                        self._slot(i).copy_(full.reshape(-1))
                else:
                    recv.copy_(self.pack_rows(fulls, self.layout, self.dtype).view(-1))
            group = mesh.shard_group if self.replicated else mesh.replicate_group
            if group is not None and dist.get_world_size(group) > 1:
                comm.broadcast(recv, group, src_rank=self.mesh.group_rank_of(group, 0), unit=name, phase=phase)
            self._store_received(recv)
            self._dirty = False
            self._versions = self._current_versions()
            return
        shard_group = mesh.shard_group
        assert shard_group is not None  # shard_size > 1
        shard_ranks = dist.get_process_group_ranks(shard_group)
        holds_source = 0 in shard_ranks
        if holds_source:
            source = self.pack_rows(fulls, self.layout, self.dtype) if is_source and fulls is not None else None
            chunks = list(source.unbind(0)) if source is not None else None
            comm.scatter(
                recv, chunks, shard_group, src_rank=mesh.group_rank_of(shard_group, 0),
                unit=name, phase=phase,
            )  # fmt: skip
        if mesh.replicate_size > 1:
            assert mesh.replicate_group is not None  # replicate_size > 1
            src = mesh.replica_source()
            comm.broadcast(recv, mesh.replicate_group, src_rank=src, unit=name, phase=phase)
        self._store_received(recv)

    def _store_received(self, recv: torch.Tensor) -> None:
        """Offloaded groups: copy what a collective delivered on the device into the host master."""
        if recv is not self.master:
            with torch.no_grad():
                self.master.copy_(recv)

    def to_dtensor(self, sp: ShardedParam, local: torch.Tensor | None = None) -> DTensor:
        """``local`` (default: ``sp``'s shard) as a DTensor piece of ``sp``'s global shape, sharing its memory.

        ``Shard(0)`` over the shard group, ``[Replicate(), Shard(0)]`` over a hybrid 2-D mesh,
        ``Replicate()`` for NO_SHARD. 0-d parameters appear with shape ``(1,)``.
        """
        local = sp.sharded.detach() if local is None else local
        if tuple(local.shape) != sp.layout.local_shape:
            raise ShardingError(
                f"a tensor of shape {tuple(local.shape)} cannot be placed like parameter '{sp.fqn}', whose local "
                f"shard has shape {sp.layout.local_shape}"
            )
        shape = sp.global_shape
        device_mesh, placements = self.mesh.dtensor_placement(local.device.type)
        return DTensor.from_local(
            local,
            device_mesh,
            placements,
            run_check=False,
            shape=torch.Size(shape),
            stride=contiguous_stride(shape),
        )

    # ------------------------------------------------------------------ deferred init
    def materialize(self, device: torch.device) -> None:
        """Give a group built on the meta device real (zeroed) storage on ``device``."""
        if self.offload is not None:
            self.offload.device = device
        self.master = self._new_master(device)
        self.device = device
        self._unsharded_flat = None  # gathered parameters are recreated on the new device
        self._post = None
        self.partial = None
        for i, sp in enumerate(self.params):
            sp.unsharded, sp.hooked = None, False
            fresh = nn.Parameter(alias(self._piece(i)), requires_grad=sp.sharded.requires_grad)
            fresh.__dict__.update(sp.sharded.__dict__)  # swap_tensors swaps Python attributes too
            torch.utils.swap_tensors(sp.sharded, fresh)  # keeps the Parameter object optimizers hold
        self._versions = self._current_versions()
        self._dirty = False


def flat_group(sp: ShardedParam) -> FlatGroup:
    """The :class:`FlatGroup` holding ``sp``'s shard.

    Note: ``ShardedParam.group`` is annotated ``object`` because param.py cannot import this module
    (this module imports it); :class:`~shardline.engine.unit.ShardUnit` sets it to the group it
    builds for the parameter, so it is always one.
    """
    return cast(FlatGroup, sp.group)
