"""The save side of the packed layout: a rank's segments as DCP write items, and rank 0's check of them.

:class:`PackedSave` is built by every rank from its flattened state dict (the save planner's
local plan): the layout table (:mod:`..format.packed_layout`; the same on every rank, since
every rank sees the same keys, shapes and meshes), this rank's segments, and one 1-D ``TENSOR``
write item per segment in place of every packable DTensor's chunk. A segment's bytes are
assembled only when DCP resolves its item (:meth:`PackedSave.segment_data`), so a rank holds at
most about one segment beyond its state while it writes.

Note: why rank 0 can trust the table it records. Each rank sends the SHA-256 of its own table's
canonical JSON in its local plan's ``planner_data`` (:data:`PLAN_DIGEST_KEY`); rank 0's global
plan check (:func:`check_packed_plan`) fails the save when any rank's digest differs from its
own table's, or when the segment items the ranks planned differ from what the table's rule
gives (``expected_segment_sizes``). A table that passes therefore describes every rank's
segments as they are written, and readers recompute each segment's contents from it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from shardline import _torch_compat
from shardline.checkpoint.format.canonical import canonical_json, sha256_hex
from shardline.checkpoint.format.packed_layout import (
    MeshSpec,
    PackedEntry,
    PackedLayout,
    Segment,
    dtype_name,
    is_segment_key,
    packing_placement,
)
from shardline.checkpoint.integrity.packed_spread import spread_segment_bytes
from shardline.errors import CheckpointError

__all__ = [
    "PLAN_DIGEST_KEY",
    "PackedSave",
    "check_packed_plan",
    "segment_write_item",
    "table_digest",
]

PLAN_DIGEST_KEY = "shardline.packed_layout.sha256"
"""Key of a local plan's ``planner_data`` holding the SHA-256 of the rank's layout table (same on every rank)."""

_SHOWN = 3  # problems named per kind in a plan-check message


def table_digest(layout: PackedLayout) -> str:
    """SHA-256 of the table's canonical JSON (what each rank sends and rank 0 compares)."""
    return sha256_hex(canonical_json(layout.to_data()))


def _first(keys: Sequence[str]) -> str:
    shown = ", ".join(repr(k) for k in keys[:_SHOWN])
    return shown + (f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else "")


@dataclass(frozen=True)
class PackedSave:
    """One rank's packed part of a save: the table, its segments, and the DTensors their pieces come from."""

    layout: PackedLayout
    rank: int
    values: dict[int, DTensor]
    """Entry index -> this rank's DTensor of it (for every entry the table has)."""
    segments: dict[str, Segment]
    """This rank's segments by key."""

    @classmethod
    def build(
        cls, state_dict: Mapping[str, Any], *, rank: int, world_size: int, segment_bytes: int, files_per_rank: int = 1
    ) -> PackedSave:
        """The table of a flattened state dict's packable DTensors (in key order) and ``rank``'s segments.

        Segments are cut at ``segment_bytes``, or smaller so that a rank's segments spread over the
        ``files_per_rank`` files it writes (0: automatic; :func:`.packed_spread.spread_segment_bytes`).

        Raises:
            CheckpointError: a DTensor's local piece is not the rows the table's rule gives this rank.
        """
        meshes: dict[MeshSpec, int] = {}
        seen: dict[tuple[int, tuple[Any, ...]], tuple[MeshSpec, int | None] | None] = {}
        entries: list[PackedEntry] = []
        values: dict[int, DTensor] = {}
        for key, value in state_dict.items():
            if not isinstance(value, DTensor):
                continue
            # Note: one DeviceMesh serves thousands of tensors; its rank list is read once per placement.
            placed_key = (id(value.device_mesh), tuple(value.placements))
            if placed_key not in seen:
                seen[placed_key] = packing_placement(value)
            placed = seen[placed_key]
            if placed is None or value.dim() == 0:
                continue
            mesh, shard_dim = placed
            index = meshes.setdefault(mesh, len(meshes))
            values[len(entries)] = value
            entries.append(PackedEntry(key, dtype_name(value.dtype), tuple(value.shape), index, shard_dim))
        layout = PackedLayout(world_size, segment_bytes, tuple(meshes), tuple(entries))
        spread = spread_segment_bytes(layout, files_per_rank=files_per_rank)
        if spread != segment_bytes:
            layout = PackedLayout(world_size, spread, layout.meshes, layout.entries)
        for i, value in values.items():
            _check_rows(layout, i, rank, value)
        segments = {s.key: s for s in layout.segments(rank)}
        return cls(layout, rank, values, segments)

    @property
    def packed_keys(self) -> set[str]:
        """The flat keys stored in segments (left out of the ordinary write items)."""
        return {e.key for e in self.layout.entries}

    def write_items(self) -> list[WriteItem]:
        """One 1-D ``TENSOR`` write item per segment of this rank."""
        return [segment_write_item(s.key, s.numel, s.dtype) for s in self.segments.values()]

    def parts(self, key: str) -> list[tuple[int, torch.Tensor]]:
        """``(element offset, flat local rows)`` of each piece of segment ``key``, in order."""
        return [
            (piece.offset, self.values[piece.entry].to_local().detach().reshape(-1))
            for piece in self.segments[key].pieces
        ]

    def segment_data(self, key: str) -> torch.Tensor:
        """Segment ``key``'s contents: its pieces' local rows, flattened and concatenated, in a new CPU tensor."""
        segment = self.segments[key]
        out = torch.empty(segment.numel, dtype=getattr(torch, segment.dtype), device="cpu")
        for offset, flat in self.parts(key):
            out[offset : offset + flat.numel()].copy_(flat)
        return out


def segment_write_item(key: str, numel: int, dtype: str) -> WriteItem:
    """The write item of segment ``key``: a plain 1-D tensor of ``numel`` elements, one chunk at offset 0."""
    size = torch.Size([numel])
    data = TensorWriteData(
        chunk=ChunkStorageMetadata(offsets=torch.Size([0]), sizes=size),
        properties=TensorProperties(dtype=getattr(torch, dtype)),
        size=size,
    )
    return WriteItem(index=MetadataIndex(key, torch.Size([0])), type=WriteItemType.TENSOR, tensor_data=data)


def _check_rows(layout: PackedLayout, entry: int, rank: int, value: DTensor) -> None:
    """``value``'s local chunk must be the rows the rule gives ``rank`` (replicas: the first replica's rows)."""
    spec = layout.entries[entry]
    if not spec.row_numel:
        return  # no elements: nothing is written
    mesh = layout.meshes[spec.mesh]
    coordinate = mesh.coordinate(rank)
    if coordinate is None:
        raise CheckpointError(
            f"packed layout: rank {rank} holds {spec.key!r} on a device mesh it is not part of (mesh ranks "
            f"{mesh.ranks[:8]}...); save with layout='per_tensor'"
        )
    first = [c if d == spec.shard_dim else 0 for d, c in enumerate(coordinate)]
    expected = layout.rows_of(entry, mesh.rank_at(first))
    chunks = _torch_compat.local_chunks(value)
    chunk = chunks[0] if len(chunks) == 1 else None
    # Note: DTensor answers its chunk from its placements; the rows are also counted in the local tensor itself,
    # whose bytes the segment takes (a piece of another length would shift every piece after it).
    local = tuple(value.to_local().shape)
    seen: tuple[int, int] | None = None
    if chunk is not None and local[0]:
        seen = (int(chunk.offsets[0]), int(chunk.offsets[0]) + local[0])
    whole_rows = chunk is not None and all(
        o == 0 and s == n == m
        for o, s, n, m in zip(chunk.offsets[1:], chunk.sizes[1:], spec.shape[1:], local[1:], strict=True)
    )
    if chunk is None or seen != expected or tuple(chunk.sizes)[:1] != local[:1] or not whole_rows:
        raise CheckpointError(
            f"packed layout: rank {rank} holds rows {seen} of {spec.key!r} (shape {spec.shape}, local shape {local}, "
            f"chunks {[(tuple(c.offsets), tuple(c.sizes)) for c in chunks]}), but the layout's rule (torch.chunk's "
            f"split of dimension 0) gives it rows {expected}; this sharding cannot be packed: save with "
            "layout='per_tensor'"
        )


def check_packed_plan(layout: PackedLayout, global_plan: list[SavePlan], metadata: Metadata) -> list[str]:
    """Rank 0's check of a packed save's global plan against its own table (empty: valid).

    Every rank's plan must carry this table's digest; the segment items planned must be exactly the
    table's (key and size); no packed tensor may also be planned as an ordinary item.
    """
    errors: list[str] = []
    digest = table_digest(layout)
    differing = [i for i, plan in enumerate(global_plan) if (plan.planner_data or {}).get(PLAN_DIGEST_KEY) != digest]
    if differing:
        ranks = ", ".join(map(str, differing[:_SHOWN])) + (" ..." if len(differing) > _SHOWN else "")
        errors.append(
            f"packed layout: {len(differing)} rank(s) (plan {ranks}) built a layout table that differs from rank "
            f"0's (sha256 {digest[:12]}): every rank must hold the same keys, shapes, dtypes and device meshes, "
            "and save with the same segment_bytes and files_per_rank"
        )
    planned: dict[str, tuple[int, ...]] = {
        key: tuple(value.size)
        for key, value in metadata.state_dict_metadata.items()
        if is_segment_key(key) and isinstance(value, TensorStorageMetadata)
    }
    expected = layout.expected_segment_sizes()
    missing = sorted(expected.keys() - planned.keys())
    unexpected = sorted(planned.keys() - expected.keys())
    wrong = sorted(k for k in expected.keys() & planned.keys() if planned[k] != (expected[k],))
    if missing:
        errors.append(f"packed layout: {len(missing)} segment(s) the table expects were not planned: {_first(missing)}")
    if unexpected:
        errors.append(
            f"packed layout: {len(unexpected)} segment(s) were planned that the table does not give: "
            f"{_first(unexpected)}"
        )
    if wrong:
        shown = ", ".join(f"{k!r} planned {planned[k]} expected ({expected[k]},)" for k in wrong[:_SHOWN])
        errors.append(f"packed layout: {len(wrong)} segment(s) of the wrong size: {shown}")
    also = [e.key for e in layout.entries if e.key in metadata.state_dict_metadata]
    if also:
        errors.append(f"packed layout: {len(also)} packed tensor(s) were also planned per tensor: {_first(also)}")
    return errors
