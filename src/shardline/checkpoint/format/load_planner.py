"""shardline's DCP load planner: a load at the saving layout finds each piece's saved chunk without a scan.

torch's load planner (``DefaultLoadPlanner``) plans every tensor with its resharding planner,
which sorts and sweeps all the saved chunks of the tensor for each rank's piece: every rank
looks at every chunk every rank saved (35M at 16,384 ranks for a 70B Llama's weights and Adam
moments, 81 s per rank; docs/benchmarks.md). A load at the world size and layout it was saved
at needs, for each piece, exactly the saved chunk with the same offsets and sizes.
:class:`ShardlineLoadPlanner` looks that chunk up first (:class:`ChunkFinder`) and reads it
with one ``ReadItem``; a tensor with no exact match (a resharded load) is planned by torch's
planner, so resharded loads are planned exactly as before.

Note: why an exact match is safe, and gives torch's own plan. torch's planner emits one read
item per saved chunk that overlaps the piece (two boxes overlap when their ranges overlap in
every dimension). When the piece is the box of saved chunk S, a saved chunk overlaps the piece
exactly when it overlaps S. Every checkpoint's saved chunks passed the save's global-plan check
(torch's, or shardline's ``plan_validation``, the same verdict): no two of them overlap. So the
only chunk torch's planner finds is S itself, read whole, at offset 0 on both sides -- the same
bytes, in one item equal to torch's (including the chunk's index in the metadata) -- or, for a
piece of no elements, none at all: a box of no elements overlaps nothing it equals. The rule is
applied only where torch's plan is one item per piece (a tensor of at least one dimension that
this rank holds in one piece: a DTensor or a plain tensor; several ShardedTensor shards and 0-d
tensors go to torch's planner), and a box recorded twice with elements (which the save's check
rejects) sends its tensor to torch's planner too.

What it costs: the chunk is probed at the position this rank's chunk held in the last tensor
found (at first, the rank: DCP lists a tensor's chunks in rank order), then at position 0 (a
tensor saved whole); a miss builds the tensor's index of boxes once (C-speed passes over its
chunks; a dict of box -> position), which also moves the probe to where this rank's chunks lie.
A same-layout load therefore examines about one saved chunk per piece, plus one tensor's chunks
where the first probe misses; a resharded load pays the index (linear) and then torch's planner
(``n log n``), as before plus the index. Where DCP lists the chunks in another order per tensor
(a hybrid mesh, whose replicated chunks DCP hands to writers by load), probes miss and each
tensor pays its index: linear, in C, over the shard group's chunks only.
"""

from __future__ import annotations

import collections
import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem
from torch.distributed.tensor import DTensor

from shardline import _torch_compat
from shardline.checkpoint.format.dcp_io import SafeLoadPlanner
from shardline.checkpoint.format.packed_reads import PackedReads
from shardline.checkpoint.format.packed_view import logical_metadata, packed_layout

__all__ = ["ChunkFinder", "ShardlineLoadPlanner"]

_Box = tuple[torch.Size, torch.Size]
_offsets = operator.attrgetter("offsets")
_sizes = operator.attrgetter("sizes")


class ChunkFinder:
    """Finds the saved chunk with a piece's exact offsets and sizes; one per load (it keeps what it learned).

    Attributes:
        examined: Saved chunks looked at so far (probes, and every chunk of a tensor whose index was built).
    """

    def __init__(self, *, position: int = 0) -> None:
        self.examined = 0
        self._start = position
        self._last = position
        self._indexes: dict[str, dict[_Box, int | None]] = {}

    def find(
        self, fqn: str, saved: TensorStorageMetadata, piece: ChunkStorageMetadata
    ) -> tuple[int, ChunkStorageMetadata] | None:
        """The saved chunk whose box is ``piece``'s and its position in ``saved.chunks``, or None (no such chunk,
        or a box with elements recorded twice)."""
        chunks = saved.chunks
        offsets, sizes = piece.offsets, piece.sizes
        for position in dict.fromkeys((self._last, self._start, 0)):
            if position < len(chunks):
                self.examined += 1
                chunk = chunks[position]
                if chunk.offsets == offsets and chunk.sizes == sizes:
                    self._last = position
                    return position, chunk
        index = self._indexes.get(fqn)
        if index is None:
            index = self._indexes[fqn] = self._index(chunks)
        found = index.get((torch.Size(offsets), torch.Size(sizes)))
        if found is None:
            return None
        self._last = found
        self.examined += 1
        return found, chunks[found]

    def _index(self, chunks: Sequence[ChunkStorageMetadata]) -> dict[_Box, int | None]:
        self.examined += len(chunks)
        boxes = list(zip(map(_offsets, chunks), map(_sizes, chunks), strict=True))
        index: dict[_Box, int | None] = dict(zip(boxes, range(len(boxes)), strict=True))
        if len(index) < len(boxes):  # a box recorded twice: one with elements is torch's planner's to plan
            for box, count in collections.Counter(boxes).items():
                if count > 1 and all(box[1]):
                    index[box] = None
        return index


def _exact_item(fqn: str, piece: ChunkStorageMetadata, position: int, saved: ChunkStorageMetadata) -> list[ReadItem]:
    """torch's read plan for a piece whose box is that of ``saved``, chunk ``position``: the whole chunk, or nothing."""
    if not all(piece.sizes):
        return []
    zeros = torch.Size([0] * len(piece.sizes))
    return [
        ReadItem(
            type=LoadItemType.TENSOR,
            dest_index=MetadataIndex(fqn, piece.offsets, 0),
            dest_offsets=zeros,
            storage_index=MetadataIndex(fqn, saved.offsets, position),
            storage_offsets=zeros,
            lengths=torch.Size(piece.sizes),
        )
    ]


class ShardlineLoadPlanner(SafeLoadPlanner):
    """The planner of every shardline load: :class:`SafeLoadPlanner` (flattening, partial loads, non-tensors read
    with ``weights_only=True``) whose pieces are found by their box first (see the module note).

    A checkpoint in the packed layout is read through its segments: every tensor the layout table lists is
    planned by :class:`~.packed_reads.PackedReads` (one read per segment; :attr:`packed` after planning).

    Args:
        rank: Where to probe first for this rank's chunks (default: this process's rank in the world, or 0).
    """

    def __init__(self, *, rank: int | None = None) -> None:
        super().__init__()
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.finder = ChunkFinder(position=rank)
        self.packed: PackedReads | None = None

    def set_up_planner(
        self, state_dict: dict[str, Any], metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        """DCP's set-up, with a packed checkpoint's metadata seen through its logical view (``packed_view.py``)."""
        if metadata is not None:
            metadata = logical_metadata(metadata)  # the same object unless it is raw packed metadata
        super().set_up_planner(state_dict, metadata, is_coordinator)

    def create_local_plan(self) -> LoadPlan:
        """This rank's read items: ``DefaultLoadPlanner``'s checks and plan, each exact piece found by its box."""
        metadata = self.metadata
        if metadata is None:
            raise AssertionError("the load planner was not set up with the checkpoint's metadata")
        if self.flatten_state_dict:
            _torch_compat.take_pre_2_4_keys(self)
        saved_items = metadata.state_dict_metadata
        layout = packed_layout(metadata)
        packed = self.packed = PackedReads(layout) if layout is not None else None
        items: list[ReadItem] = []
        for fqn, value in self.state_dict.items():
            saved = saved_items.get(fqn)
            if saved is None:
                if not self.allow_partial_load:
                    raise RuntimeError(f"Missing key in checkpoint state_dict: {fqn}.")  # torch's message
                continue
            size = getattr(value, "size", None)
            if isinstance(saved, TensorStorageMetadata) and size is not None and saved.size != size():
                raise ValueError(f"Size mismatch between saved {saved.size} and current: {size()} for {fqn}")
            if isinstance(value, DTensor) and value.device_mesh.get_coordinate() is None:
                continue  # this rank is not in the DTensor's mesh
            if packed is not None and fqn in packed.layout.by_key:
                packed.add(fqn, value)
                continue
            items += self._read_items(fqn, saved, value)
        if packed is not None:
            items += packed.read_items()
        return LoadPlan(items)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        """The target of ``read_item``: a staging buffer for a packed segment's read, else DCP's."""
        if self.packed is not None and self.packed.owns(read_item):
            return self.packed.staging(read_item)
        target: torch.Tensor = super().resolve_tensor(read_item)
        return target

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        """A packed segment's read copied into the pieces it serves; other reads are in place already."""
        if self.packed is not None and self.packed.owns(read_item):
            self.packed.commit(read_item, tensor)
            return
        super().commit_tensor(read_item, tensor)

    def _read_items(
        self, fqn: str, saved: TensorStorageMetadata | BytesStorageMetadata, value: object
    ) -> list[ReadItem]:
        if isinstance(saved, TensorStorageMetadata) and len(saved.size) > 0:
            try:
                pieces = _torch_compat.local_chunks(value)
            except ValueError:
                pieces = []  # not a tensor: torch's planner raises its own error
            if len(pieces) == 1:
                found = self.finder.find(fqn, saved, pieces[0])
                if found is not None:
                    return _exact_item(fqn, pieces[0], *found)
        return _torch_compat.read_items_by_torch(fqn, saved, value)
