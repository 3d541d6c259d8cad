"""A unit's 4-bit frozen weights: sharded along their quantization blocks, gathered with the unit.

Formats: torchao's ``NF4Tensor`` and bitsandbytes' ``Params4bit`` (nf4 or fp4, with or without
double quantization). The notes below speak of NF4; each format's own layout -- what a *group*
is, its components, how it is rebuilt -- lives in its module behind one small protocol
(:class:`~shardline.engine.quant_format.QuantFormat`: :mod:`~shardline.engine.nf4`,
:mod:`~shardline.engine.bnb4`).

Note: why NF4 weights stay out of the flat buffers. A :class:`~shardline.engine.flat.FlatGroup`
packs parameters into one floating-point buffer per dtype; an NF4 weight copied into one would
be dequantized -- four or eight times its bytes, the silent "no memory savings" of 4-bit bases
under other sharded engines. So a unit keeps its NF4 weights in a :class:`QuantizedGroup`
beside its flat groups:

* **shard**: each weight is cut into whole *scaler groups* (``block_size * scaler_block_size``
  elements, :mod:`shardline.engine.nf4`), ``ceil(groups / W)`` per rank. This rank's piece of
  every component -- the packed 4-bit codes, the int8 block scalers, the per-group
  quantization factors -- lives in one byte buffer per rank (``local``), each part at the same
  offset on every rank, zero-padded to the same size. Registered on the modules between steps
  is a 1-D NF4 tensor over this rank's piece (views into ``local``, the tensor's own
  ``scaler_mean`` and code book), frozen: 1/W of the 4-bit bytes.
* **gather**: when the unit gathers, one all-gather of ``local`` (uint8; counted in the unit's
  collectives like its other gathers), then each weight's parts are concatenated from every
  rank's valid range into a full NF4 tensor of the original shape, registered for forward and
  backward and dropped when the unit reshards. Not prefetched; ``reshard_after_forward=N``
  frees it completely (backward gathers over the whole shard group; the bytes are the same).
* **offload**: under :class:`~shardline.CPUOffload` ``local`` lives in host memory (pinned when
  the device is CUDA), so the device holds none of the 4-bit bytes between uses; each gather
  first copies it to a device staging buffer through the unit's
  :class:`~shardline.engine.offload.HostCopies` (counted like the float shards' copies), then
  gathers that. The staging copy counts in ``comm_buffers`` until the gather has sent it.
* **check**: the group records a checksum of every component of each weight as it was handed
  to ``fully_shard``. :func:`verify_quantized` (the first forward of each root runs it) gathers
  every group once and compares: a weight whose quantization state was dropped, zeroed or
  replaced on the way (wrapping, materialization, a load) is refused by name before any step.

Quantized weights are frozen: never trained, reduced or given to an optimizer, and left out of
``state_dict()`` (a checkpoint holds what training changes; the base comes from its source).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardline.engine.bnb4 import Params4bitFormat, is_params4bit
from shardline.engine.comm import Comm
from shardline.engine.memory import MemoryTracker, nbytes
from shardline.engine.mesh import ShardMesh
from shardline.engine.nf4 import NF4Format, is_nf4
from shardline.engine.offload import HostCopies
from shardline.engine.quant_format import QuantFormat
from shardline.errors import ShardingError

__all__ = ["QuantizedGroup", "QuantizedParam", "is_quantized", "split_quantized", "verify_quantized"]

_ALIGN = 16  # byte alignment of each part inside the per-rank buffer (so float parts can be viewed in place)

Entry = tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]


def split_quantized(entries: Sequence[Entry]) -> tuple[list[Entry], list[Entry]]:
    """``entries`` split into (ordinary parameters, 4-bit weights)."""
    plain = [e for e in entries if not is_quantized(e[1])]
    quantized = [e for e in entries if is_quantized(e[1])]
    return plain, quantized


def is_quantized(tensor: object) -> bool:
    """Whether ``tensor`` is a 4-bit weight the engine shards by quantization group."""
    return is_nf4(tensor) or is_params4bit(tensor)


def _format_of(fqn: str, tensor: object) -> QuantFormat:
    try:
        return Params4bitFormat.of(tensor) if is_params4bit(tensor) else NF4Format.of(tensor)
    except ValueError as exc:
        raise ShardingError(f"4-bit weight '{fqn}' ({type(tensor).__name__}) cannot be sharded: {exc}.") from exc


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass(eq=False)
class QuantizedParam:
    """One 4-bit weight of a unit (see the module note)."""

    fqn: str
    locations: list[tuple[nn.Module, str]]
    layout: QuantFormat
    start: int  # this rank's first group
    count: int  # groups this rank holds
    chunk: int  # groups every rank's record has room for
    offsets: tuple[int, ...]  # byte offset of each component in the per-rank record
    expected: tuple[int, ...]  # checksum of the weight handed to fully_shard
    sharded: nn.Parameter | None = None
    unsharded: nn.Parameter | None = None

    def register(self, tensor: nn.Parameter) -> None:
        for module, name in self.locations:
            module._parameters[name] = tensor


def _quantized_parts(tensor: torch.Tensor, layout: QuantFormat, start: int, count: int) -> tuple[torch.Tensor, ...]:
    """The components of groups ``[start, start + count)`` of the 4-bit weight ``tensor`` (flat views)."""
    return layout.parts(tensor, start, count)


class QuantizedGroup:
    """The 4-bit weights of one unit: this rank's blocks of each in one byte buffer, gathered together."""

    def __init__(
        self,
        entries: Sequence[Entry],
        *,
        mesh: ShardMesh,
        device: torch.device,
        shard: bool,
        offload: HostCopies | None = None,
    ) -> None:
        self.mesh = mesh
        self.device = device
        self.offload = offload  # CPU offload: ``local`` lives in host memory (see the module note)
        self.world = mesh.shard_size if shard else 1
        rank = mesh.shard_rank if shard else 0
        self.verified = False
        self.params: list[QuantizedParam] = []
        offset = 0
        for fqn, original, locations in entries:
            tensor: Any = original  # a torchao NF4Tensor or bitsandbytes Params4bit (untyped)
            if tensor.device.type == "meta" or tensor.device != device:
                raise ShardingError(
                    f"4-bit weight '{fqn}' is on {tensor.device}, the unit on {device}. Quantize real weights on the "
                    "unit's device before sharding (a 4-bit tensor cannot be materialized from the meta device: its "
                    "blocks are computed from the weights' values)."
                )
            layout = _format_of(fqn, tensor)
            groups = layout.groups
            broken = layout.problems(tensor, groups=groups)
            if broken:
                raise ShardingError(
                    f"4-bit weight '{fqn}' ({layout.describe()}) is not a consistent {layout.kind}: "
                    f"{'; '.join(broken)}. {layout.requantize_hint()}"
                )
            chunk = -(-groups // self.world)
            start = min(rank * chunk, groups)
            count = min(chunk, groups - start)
            offsets = []
            for numel, dtype in zip(layout.component_numels(chunk), layout.component_dtypes(), strict=True):
                offsets.append(offset)
                offset += _aligned(numel * torch.empty((), dtype=dtype).element_size())
            self.params.append(
                QuantizedParam(
                    fqn=fqn,
                    locations=locations,
                    layout=layout,
                    start=start,
                    count=count,
                    chunk=chunk,
                    offsets=tuple(offsets),
                    expected=layout.checksum(tensor),
                )
            )
        self.record_bytes = offset
        # This rank's pieces: one zero-padded record, the same layout on every rank (on the host when offloaded).
        self.local = (
            offload.host_zeros(offset, torch.uint8)
            if offload is not None
            else torch.zeros(offset, dtype=torch.uint8, device=device)
        )
        for qp, (_, original, _) in zip(self.params, entries, strict=True):
            layout = qp.layout
            with torch.no_grad():
                for view, part in zip(self._views(self.local, qp, qp.count), _local_parts(original, qp), strict=True):
                    view.copy_(part)
            qp.sharded = layout.build(self._views(self.local, qp, qp.count), shape=(qp.count * layout.group_numel,))
            qp.register(qp.sharded)
            for module, _ in qp.locations:
                layout.release_owner(module)
        self._gathered = False
        self._held = 0  # bytes of the gathered weights, counted in unsharded_params

    # ------------------------------------------------------------------ layout
    @staticmethod
    def _views(record: torch.Tensor, qp: QuantizedParam, groups: int) -> tuple[torch.Tensor, ...]:
        """``qp``'s components for ``groups`` scaler groups, viewed in one rank's ``record``."""
        views = []
        for start, numel, dtype in zip(
            qp.offsets, qp.layout.component_numels(groups), qp.layout.component_dtypes(), strict=True
        ):
            size = numel * torch.empty((), dtype=dtype).element_size()
            views.append(record[start : start + size].view(dtype))
        return tuple(views)

    @property
    def local_bytes(self) -> int:
        """Bytes this rank holds of the group's 4-bit weights (padding included)."""
        return nbytes(self.local)

    def _rank_count(self, qp: QuantizedParam, rank: int) -> int:
        groups = qp.layout.groups
        return max(0, min(qp.chunk, groups - rank * qp.chunk))

    # ------------------------------------------------------------------ gather / free
    def _gather(self, *, comm: Comm, memory: MemoryTracker, name: str, phase: str) -> list[nn.Parameter]:
        """Every weight of the group as a full 4-bit weight (one all-gather; a copy when not sharded)."""
        local = self.local
        if self.offload is not None:  # host -> device first; the staged copy lives until the gather has sent it
            local = self.offload.to_device(self.local)
            memory.add("comm_buffers", nbytes(local))
        if self.world == 1:
            received = local
        else:
            group = self.mesh.shard_group
            assert group is not None  # a shard group of several ranks exists
            received = torch.empty(self.world * self.record_bytes, dtype=torch.uint8, device=self.device)
            memory.add("comm_buffers", nbytes(received))
            comm.all_gather(received, local, group, unit=name, phase=phase)
            if local is not self.local:
                memory.add("comm_buffers", -nbytes(local))
                del local
        records = received.view(self.world, self.record_bytes)
        fulls = []
        for qp in self.params:
            pieces = [self._views(records[r], qp, self._rank_count(qp, r)) for r in range(self.world)]
            parts = tuple(torch.cat([p[i] for p in pieces]) for i in range(len(qp.layout.components)))
            fulls.append(qp.layout.build(parts))
        if received is not self.local:  # an all-gather's output, or (offloaded, one rank) the staged copy
            memory.add("comm_buffers", -nbytes(received))
        return fulls

    def unshard(self, *, comm: Comm, memory: MemoryTracker, name: str, phase: str) -> None:
        """Gather every weight and register the full 4-bit weights on the modules (no-op when gathered)."""
        if self._gathered:
            return
        fulls = self._gather(comm=comm, memory=memory, name=name, phase=phase)
        held = 0
        for qp, full in zip(self.params, fulls, strict=True):
            qp.unsharded = full
            qp.register(qp.unsharded)
            held += sum(nbytes(part) for part in qp.layout.parts(full, 0, qp.layout.groups))
        self._held = held
        memory.add("unsharded_params", held)
        self._gathered = True

    def free(self, memory: MemoryTracker) -> None:
        """Register the shards again and drop the gathered weights (autograd may hold them until backward)."""
        for qp in self.params:
            assert qp.sharded is not None
            qp.register(qp.sharded)
            qp.unsharded = None
        if self._gathered:
            memory.add("unsharded_params", -self._held)
            self._held = 0
            self._gathered = False

    # ------------------------------------------------------------------ the check
    def verify(self, *, comm: Comm, memory: MemoryTracker, name: str) -> list[str]:
        """Problems of this rank's weights (empty if none): each still 4-bit, with the quantization state it came with.

        A collective (one gather of the group) on the shard group's ranks.
        """
        found = []
        for qp in self.params:
            for module, attr in qp.locations:
                registered = module._parameters.get(attr)
                if registered is not qp.sharded and registered is not qp.unsharded:
                    found.append(
                        f"'{name}.{qp.fqn}': the module holds another tensor ({type(registered).__name__}) than the "
                        "4-bit shard fully_shard registered"
                    )
            for problem in qp.layout.problems(qp.sharded, groups=qp.count):
                found.append(f"'{name}.{qp.fqn}' (this rank's shard): {problem}")
        fulls = self._gather(comm=comm, memory=memory, name=name, phase="init")
        for qp, full in zip(self.params, fulls, strict=True):
            got = qp.layout.checksum(full)
            if got != qp.expected:
                changed = [
                    part
                    for i, part in enumerate(qp.layout.checksum_names)
                    if got[3 * i : 3 * i + 3] != qp.expected[3 * i : 3 * i + 3]
                ]
                parts = ", ".join(changed)
                found.append(
                    f"'{name}.{qp.fqn}': its quantization state changed since fully_shard (gathered {parts} "
                    "differ from the weight that was sharded)"
                )
        self.verified = True
        return found


def _local_parts(tensor: torch.Tensor, qp: QuantizedParam) -> tuple[torch.Tensor, ...]:
    """Components of this rank's groups of ``tensor``."""
    return _quantized_parts(tensor, qp.layout, qp.start, qp.count)


def verify_quantized(units: Sequence[object], *, comm: Comm, group: dist.ProcessGroup | None) -> None:
    """Refuse to go on unless every 4-bit weight of ``units`` kept its quantization state (a collective).

    Every rank gathers each unit's quantized group once and compares it with what was sharded
    (see the module note); then the ranks agree, so all of them raise (naming each weight and
    the rank that found it) or none does.

    Raises:
        ShardingError: Some weight lost (part of) its quantization state.
    """
    found: list[str] = []
    for unit in units:
        quantized = getattr(unit, "quantized", None)
        if isinstance(quantized, QuantizedGroup):
            found += quantized.verify(comm=comm, memory=unit.ctx.memory, name=unit.display_name)  # type: ignore[attr-defined]
    if group is not None and dist.get_world_size(group) > 1:
        world = dist.get_world_size(group)
        everyone: list[list[str] | None] = [None] * world
        dist.all_gather_object(everyone, found, group=group)
        ranks: dict[str, list[int]] = {}
        for r, problems in enumerate(everyone):
            for problem in problems or []:
                ranks.setdefault(problem, []).append(r)
        found = [
            f"{problem} ({'every rank' if len(rs) == world else 'rank ' + ', '.join(map(str, rs))})"
            for problem, rs in ranks.items()
        ]
    if found:
        raise ShardingError(
            f"{len(found)} 4-bit weight problem(s) found before the first step: "
            + "; ".join(found[:10])
            + ". Training would compute with corrupted base weights (wrong or NaN losses and gradients). "
            "Quantize the weights (torchao to_nf4, or bitsandbytes Params4bit) on their final device before "
            "fully_shard, and do not replace or modify them afterwards."
        )
