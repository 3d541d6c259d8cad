"""The packed checkpoint layout: each rank's row shards of every tensor stored as a few flat segments.

DCP records one chunk per rank for every tensor it saves. For a 70B Llama's weights and Adam
moments sharded over 16,384 ranks that is 35M chunks: rank 0's global plan and ``.metadata``
(2.9 GB) take minutes, and every rank unpickles the metadata at load (docs/benchmarks.md). The
packed layout stores instead, per rank and dtype, the concatenation of that rank's row shards in
a fixed order, cut into segments of at most ``segment_bytes``; DCP sees one plain 1-D tensor per
segment (``W x dtypes`` items, about one per rank and state kind), and a **layout table** in the
metadata says how to find any tensor's rows in them.

Note: why the table can stay O(tensors), not O(tensors x ranks). Which rows of a tensor a rank
holds follows a rule, not a record: a tensor sharded ``Shard(0)`` over a mesh dimension of size G
gives coordinate ``s`` the rows ``[s*c, min((s+1)*c, R))`` with ``c = ceil(R/G)`` (torch.chunk's
split, what DTensor and shardline's engine use); on every ``Replicate()`` dimension only the ranks
at coordinate 0 write (the other replicas hold the same bytes). Each rank's pieces follow the
table's order, skipping pieces of no rows, and a new segment starts where the next piece would
push the current one past ``segment_bytes`` (a piece larger than that is a segment of its own).
Readers and the save's plan check recompute every segment's size and contents from the table:
a save whose segments do not match the rule fails its plan check, so a reader never trusts a
table the writers did not follow. Tensors the rule does not describe (other placements, 0-d
tensors, plain tensors, bytes) are stored as ordinary DCP items beside the segments.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.tensor import DTensor, Replicate, Shard

from shardline.errors import ConfigurationError, IntegrityError

__all__ = [
    "DEFAULT_SEGMENT_BYTES",
    "PACKED_LAYOUT_KEY",
    "SEGMENT_PREFIX",
    "CheckpointLayout",
    "MeshSpec",
    "PackedEntry",
    "PackedLayout",
    "Piece",
    "Segment",
    "dtype_name",
    "holds_packable",
    "is_segment_key",
    "layout_of",
    "packing_placement",
    "segment_key",
]

PACKED_LAYOUT_KEY = "shardline.packed_layout"
"""Where the layout table lives: a key of the DCP metadata's ``planner_data`` (plain data)."""
SEGMENT_PREFIX = "_shardline_packed"
"""Flat DCP key prefix of the segments: ``_shardline_packed.r<rank>.<dtype>.s<index>``."""
DEFAULT_SEGMENT_BYTES = 256 * 2**20
_VERSION = 1


class CheckpointLayout(str, enum.Enum):
    """How a sharded checkpoint stores its tensors.

    ``per_tensor`` (default; aliases ``tensor``, ``dcp``): one DCP item per tensor, a chunk per rank
    -- any DCP reader loads it. ``packed`` (alias ``segments``): each rank's row shards in a few flat
    segments and a layout table -- metadata O(ranks + tensors) instead of O(ranks x tensors), for
    thousands of ranks; read by shardline (load, consolidate, export, inspect), not by plain
    ``dcp.load``.
    """

    PER_TENSOR = "per_tensor"
    PACKED = "packed"

    @classmethod
    def parse(cls, value: CheckpointLayout | str) -> CheckpointLayout:
        """The layout named by ``value`` (member, value, name in any case, or alias)."""
        if isinstance(value, cls):
            return value
        key = str(value).strip().lower().replace("-", "_")
        found = _ALIASES.get(key)
        if found is None:
            raise ConfigurationError(
                f"unknown checkpoint layout {value!r}; choose 'per_tensor' (aliases 'tensor', 'dcp') or 'packed' "
                "(alias 'segments')"
            )
        return found


_ALIASES = {
    "per_tensor": CheckpointLayout.PER_TENSOR,
    "tensor": CheckpointLayout.PER_TENSOR,
    "dcp": CheckpointLayout.PER_TENSOR,
    "packed": CheckpointLayout.PACKED,
    "segments": CheckpointLayout.PACKED,
}


def segment_key(rank: int, dtype: str, index: int) -> str:
    """The flat DCP key of rank ``rank``'s segment ``index`` of dtype ``dtype``."""
    return f"{SEGMENT_PREFIX}.r{rank}.{dtype}.s{index}"


def is_segment_key(key: str) -> bool:
    """Whether a flat DCP key names a packed segment (one :func:`segment_key` made)."""
    return key.startswith(SEGMENT_PREFIX + ".")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _itemsize(dtype: str) -> int:
    found = getattr(torch, dtype, None)
    if not isinstance(found, torch.dtype):
        raise IntegrityError(f"the packed layout table names dtype {dtype!r}, which torch does not have")
    return found.itemsize


@dataclass(frozen=True)
class MeshSpec:
    """A device mesh as the table records it: its shape and its global ranks in row-major order."""

    shape: tuple[int, ...]
    ranks: tuple[int, ...]

    @cached_property
    def _position(self) -> dict[int, int]:
        return {rank: i for i, rank in enumerate(self.ranks)}

    def coordinate(self, rank: int) -> tuple[int, ...] | None:
        """``rank``'s coordinate in the mesh, or None when it is not in it."""
        i = self._position.get(rank)
        if i is None:
            return None
        return tuple(int(c) for c in np.unravel_index(i, self.shape))

    def rank_at(self, coordinate: Sequence[int]) -> int:
        """The global rank at ``coordinate``."""
        return self.ranks[int(np.ravel_multi_index(tuple(coordinate), self.shape))]


@dataclass(frozen=True)
class PackedEntry:
    """One packed tensor: its flat DCP key, dtype name, global shape, mesh, and the mesh dimension that splits
    its rows (``Shard(0)``), or None when every mesh dimension replicates it."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    mesh: int
    shard_dim: int | None

    @property
    def row_numel(self) -> int:
        """Elements per row (dimension 0)."""
        return math.prod(self.shape[1:])


@dataclass(frozen=True)
class Piece:
    """A rank's rows ``[start, stop)`` of entry ``entry``, at element ``offset`` of its segment."""

    entry: int
    start: int
    stop: int
    offset: int
    numel: int


@dataclass(frozen=True)
class Segment:
    """One stored segment: its DCP key, writer rank, dtype, index among the rank's segments of that dtype, and the
    pieces it holds in order."""

    key: str
    rank: int
    dtype: str
    index: int
    numel: int
    pieces: tuple[Piece, ...]


@dataclass(frozen=True)
class PackedLayout:
    """The layout table of a packed checkpoint (see the module note)."""

    world_size: int
    segment_bytes: int
    meshes: tuple[MeshSpec, ...]
    entries: tuple[PackedEntry, ...]
    _segments: dict[int, tuple[Segment, ...]] = field(default_factory=dict, compare=False, repr=False)
    _located: dict[int, dict[int, tuple[Segment, Piece]]] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.segment_bytes <= 0:
            raise ConfigurationError(f"the packed layout's segment size must be positive, got {self.segment_bytes}")

    # -- the rule ---------------------------------------------------------------------------------------

    def rows_of(self, entry: int, rank: int) -> tuple[int, int] | None:
        """The rows ``[start, stop)`` of entry ``entry`` that ``rank`` writes, or None when it writes none of it
        (not in the mesh, a replica other than the first, or an empty share)."""
        spec = self.entries[entry]
        mesh = self.meshes[spec.mesh]
        coordinate = mesh.coordinate(rank)
        if coordinate is None:
            return None
        if any(c != 0 for d, c in enumerate(coordinate) if d != spec.shard_dim):
            return None
        rows = spec.shape[0]
        if not spec.row_numel:
            return None
        if spec.shard_dim is None:
            return (0, rows) if rows else None
        chunk = -(-rows // mesh.shape[spec.shard_dim])
        start = min(coordinate[spec.shard_dim] * chunk, rows)
        stop = min(start + chunk, rows)
        return (start, stop) if stop > start else None

    def sources(self, entry: int, start: int, stop: int) -> list[tuple[int, int, int]]:
        """``(writer rank, start, stop)`` for the saved pieces that hold rows ``[start, stop)`` of entry ``entry``."""
        spec = self.entries[entry]
        mesh = self.meshes[spec.mesh]
        origin = [0] * len(mesh.shape)
        if spec.shard_dim is None:
            return [(mesh.rank_at(origin), start, stop)] if stop > start else []
        rows = spec.shape[0]
        chunk = -(-rows // mesh.shape[spec.shard_dim])
        out = []
        for s in range(start // chunk, (stop - 1) // chunk + 1) if stop > start else ():
            origin[spec.shard_dim] = s
            lo, hi = max(start, s * chunk), min(stop, (s + 1) * chunk, rows)
            if hi > lo:
                out.append((mesh.rank_at(origin), lo, hi))
        return out

    def segments(self, rank: int) -> tuple[Segment, ...]:
        """Every segment ``rank`` writes, in dtype order of first appearance, each with its pieces."""
        found = self._segments.get(rank)
        if found is not None:
            return found
        cap = self.segment_bytes
        open_: dict[str, list[Piece]] = {}
        filled: dict[str, int] = {}
        count: dict[str, int] = {}
        index: dict[str, int] = {}
        done: list[Segment] = []

        def close(dtype: str) -> None:
            pieces = open_.pop(dtype)
            numel = sum(p.numel for p in pieces)
            done.append(
                Segment(segment_key(rank, dtype, index[dtype]), rank, dtype, index[dtype], numel, tuple(pieces))
            )
            index[dtype] += 1
            filled[dtype] = 0
            count[dtype] = 0

        for i, spec in enumerate(self.entries):
            rows = self.rows_of(i, rank)
            if rows is None:
                continue
            numel = (rows[1] - rows[0]) * spec.row_numel
            size = numel * _itemsize(spec.dtype)
            index.setdefault(spec.dtype, 0)
            used = filled.get(spec.dtype, 0)
            if spec.dtype in open_ and used + size > cap:
                close(spec.dtype)
                used = 0
            offset = count.get(spec.dtype, 0)
            open_.setdefault(spec.dtype, []).append(Piece(i, rows[0], rows[1], offset, numel))
            count[spec.dtype] = offset + numel
            filled[spec.dtype] = used + size
        for dtype in list(open_):
            close(dtype)
        done.sort(key=lambda s: (s.dtype, s.index))
        result = tuple(done)
        self._segments[rank] = result
        return result

    def locate(self, entry: int, rank: int) -> tuple[Segment, Piece]:
        """The segment and piece in which ``rank`` stored its rows of entry ``entry``.

        Raises:
            IntegrityError: ``rank`` writes no rows of it (a caller asked for a piece :meth:`sources` did not give).
        """
        located = self._located.get(rank)
        if located is None:
            located = {p.entry: (s, p) for s in self.segments(rank) for p in s.pieces}
            self._located[rank] = located
        found = located.get(entry)
        if found is not None:
            return found
        raise IntegrityError(f"rank {rank} stored no rows of {self.entries[entry].key!r} in the packed layout")

    def expected_segment_sizes(self) -> dict[str, int]:
        """``segment key -> elements`` for every segment of every rank, from the table alone.

        Vectorized over the ranks (one pass over the entries with per-rank arrays): the save's plan check
        compares it with what the ranks planned, at 16,384 ranks in well under a second.
        """
        world = self.world_size
        cap = self.segment_bytes
        coords = []
        for mesh in self.meshes:
            axes = np.unravel_index(np.arange(len(mesh.ranks)), mesh.shape)
            coords.append((np.asarray(mesh.ranks, dtype=np.int64), np.stack(axes, axis=1)))
        state: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        closed: list[tuple[str, np.ndarray, np.ndarray, np.ndarray]] = []
        for spec in self.entries:
            ranks, grid = coords[spec.mesh]
            writes = np.ones(len(ranks), dtype=bool)
            for d in range(grid.shape[1]):
                if d != spec.shard_dim:
                    writes &= grid[:, d] == 0
            rows_total = spec.shape[0]
            if spec.shard_dim is None:
                rows = np.full(len(ranks), rows_total, dtype=np.int64)
            else:
                chunk = -(-rows_total // self.meshes[spec.mesh].shape[spec.shard_dim])
                start = np.minimum(grid[:, spec.shard_dim].astype(np.int64) * chunk, rows_total)
                rows = np.minimum(start + chunk, rows_total) - start
            size = np.zeros(world, dtype=np.int64)
            size[ranks[writes]] = rows[writes] * spec.row_numel * _itemsize(spec.dtype)
            used, index = state.setdefault(spec.dtype, (np.zeros(world, np.int64), np.zeros(world, np.int64)))
            new = (size > 0) & (used > 0) & (used + size > cap)
            if new.any():
                where = np.nonzero(new)[0]
                closed.append((spec.dtype, where, index[where].copy(), used[where].copy()))
                index[where] += 1
                used[where] = 0
            used += size
        for dtype, (used, index) in state.items():
            where = np.nonzero(used)[0]
            closed.append((dtype, where, index[where], used[where]))
        out: dict[str, int] = {}
        for dtype, where, index, used in closed:
            itemsize = _itemsize(dtype)
            for r, i, b in zip(where.tolist(), index.tolist(), used.tolist(), strict=True):
                out[segment_key(r, dtype, i)] = b // itemsize
        return out

    # -- plain data ------------------------------------------------------------------------------------

    def to_data(self) -> dict[str, Any]:
        """The table as plain data (lists, ints, strings), as stored in the metadata."""
        return {
            "version": _VERSION,
            "world_size": self.world_size,
            "segment_bytes": self.segment_bytes,
            "meshes": [{"shape": list(m.shape), "ranks": list(m.ranks)} for m in self.meshes],
            "entries": [[e.key, e.dtype, list(e.shape), e.mesh, e.shard_dim] for e in self.entries],
        }

    @classmethod
    def from_data(cls, data: Any, *, where: object) -> PackedLayout:
        """Parse :meth:`to_data`'s output, checking every field.

        Raises:
            IntegrityError: the table is malformed (``where`` names the checkpoint).
        """
        try:
            if data["version"] != _VERSION:
                raise ValueError(f"version {data['version']!r}, this shardline reads version {_VERSION}")
            world = int(data["world_size"])
            meshes = []
            for m in data["meshes"]:
                shape = tuple(int(n) for n in m["shape"])
                ranks = tuple(int(r) for r in m["ranks"])
                if math.prod(shape) != len(ranks) or any(not 0 <= r < world for r in ranks):
                    raise ValueError(f"a mesh of shape {shape} lists {len(ranks)} ranks (world {world})")
                meshes.append(MeshSpec(shape, ranks))
            entries = []
            for key, dtype, shape, mesh, shard_dim in data["entries"]:
                dims = tuple(int(n) for n in shape)
                if not dims or not 0 <= int(mesh) < len(meshes):
                    raise ValueError(f"entry {key!r} has shape {dims} and mesh {mesh}")
                if shard_dim is not None and not 0 <= int(shard_dim) < len(meshes[int(mesh)].shape):
                    raise ValueError(f"entry {key!r} is split on mesh dimension {shard_dim}")
                if not isinstance(getattr(torch, str(dtype), None), torch.dtype):
                    raise ValueError(f"entry {key!r} has dtype {dtype!r}, which torch does not have")
                entries.append(
                    PackedEntry(str(key), str(dtype), dims, int(mesh), None if shard_dim is None else int(shard_dim))
                )
            return cls(world, int(data["segment_bytes"]), tuple(meshes), tuple(entries))
        except (KeyError, TypeError, ValueError) as e:
            raise IntegrityError(
                f"{where}: the packed layout table in the checkpoint's metadata is malformed ({type(e).__name__}: {e})"
            ) from None

    @cached_property
    def by_key(self) -> dict[str, int]:
        """``flat key -> entry index``."""
        return {e.key: i for i, e in enumerate(self.entries)}


def packing_placement(value: object) -> tuple[MeshSpec, int | None] | None:
    """``(mesh, row-splitting mesh dimension or None)`` for a tensor the packed layout can store, else None.

    Packable: a DTensor of at least one dimension whose placements are ``Replicate()`` and at most one
    ``Shard(0)``, on a mesh this process is part of.
    """
    if not isinstance(value, DTensor) or value.dim() == 0:
        return None
    shard_dim: int | None = None
    for d, placement in enumerate(value.placements):
        if isinstance(placement, Shard) and placement.dim == 0 and shard_dim is None:
            shard_dim = d
        elif not isinstance(placement, Replicate):
            return None
    mesh = value.device_mesh
    if mesh.get_coordinate() is None:
        return None
    ranks = tuple(int(r) for r in mesh.mesh.flatten().tolist())
    return MeshSpec(tuple(int(n) for n in mesh.shape), ranks), shard_dim


def holds_packable(state: object) -> bool:
    """Whether a (nested) state dict holds a tensor :func:`packing_placement` accepts.

    A packed save of a state without one would store nothing in segments and record an empty table:
    the save path stores such a state per tensor instead (``lifecycle/capture.py``).
    """
    if isinstance(state, Mapping):
        return any(holds_packable(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return any(holds_packable(value) for value in state)
    return isinstance(state, DTensor) and packing_placement(state) is not None


def layout_of(metadata: Metadata | None, *, where: object = "the checkpoint") -> PackedLayout | None:
    """The layout table recorded in ``metadata``, or None for a checkpoint in the per-tensor layout."""
    data = metadata.planner_data if metadata is not None else None
    if not isinstance(data, Mapping) or PACKED_LAYOUT_KEY not in data:
        return None
    return PackedLayout.from_data(data[PACKED_LAYOUT_KEY], where=where)


def dtype_name(dtype: torch.dtype) -> str:
    """A torch dtype's name as the table writes it (``float32``, ``bfloat16``)."""
    return _dtype_name(dtype)
