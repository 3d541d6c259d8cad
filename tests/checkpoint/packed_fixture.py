"""Packed checkpoints built from known full tensors, without a save planner or a process group.

Each rank's segments are cut from the full tensors by the layout's own rule (``PackedLayout.segments``),
saved with plain ``dcp.save(no_dist=True)`` under their segment keys beside any other items, and the table
(plus the flattening of the logical keys) is added to the DCP metadata's ``planner_data``.
"""

from __future__ import annotations

import pickle
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from shardline.checkpoint.format.dcp_io import MetadataReader
from shardline.checkpoint.format.packed_layout import PACKED_LAYOUT_KEY, MeshSpec, PackedEntry, PackedLayout


def full_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """``model`` tensors of a few shapes and dtypes (flat keys ``model.<name>``)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed": torch.randn(11, 6, generator=g),
        "model.w1": torch.randn(8, 6, generator=g),
        "model.bias": torch.randn(7, generator=g),
        "model.w2": torch.randn(5, 3, generator=g).to(torch.bfloat16),
        "model.norm": torch.randn(6, generator=g),
    }


def layout_for(
    tensors: dict[str, torch.Tensor], meshes: tuple[MeshSpec, ...], *, shard_dim: int | None, segment_bytes: int
) -> PackedLayout:
    """Every tensor on mesh 0, split on ``shard_dim`` (None: replicated)."""
    world = max(r for m in meshes for r in m.ranks) + 1
    entries = tuple(
        PackedEntry(key, str(t.dtype).removeprefix("torch."), tuple(t.shape), 0, shard_dim)
        for key, t in tensors.items()
    )
    return PackedLayout(world, segment_bytes, meshes, entries)


def _nested(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flat.items():
        top, _, rest = key.partition(".")
        if rest:
            out.setdefault(top, {})[rest] = value
        else:
            out[key] = value
    return out


def write_per_tensor(path: Path, tensors: dict[str, torch.Tensor], extra: dict[str, Any] | None = None) -> None:
    """The same state in the per-tensor layout (one item per tensor)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.save(
            _nested({k: v.clone() for k, v in tensors.items()}) | (extra or {}), checkpoint_id=str(path), no_dist=True
        )


def write_packed(
    path: Path, layout: PackedLayout, tensors: dict[str, torch.Tensor], extra: dict[str, Any] | None = None
) -> None:
    """A packed checkpoint of ``tensors`` as ``layout``'s writers would store it."""
    state: dict[str, Any] = {}
    for rank in range(layout.world_size):
        for segment in layout.segments(rank):
            parts = []
            for piece in segment.pieces:
                entry = layout.entries[piece.entry]
                parts.append(tensors[entry.key][piece.start : piece.stop].reshape(-1))
            state[segment.key] = torch.cat(parts).clone()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.save(state | (extra or {}), checkpoint_id=str(path), no_dist=True)
    add_table(path, layout.to_data(), keys=[e.key for e in layout.entries])


def add_table(path: Path, table: Any, *, keys: list[str]) -> None:
    """Rewrite ``path``'s ``.metadata`` with ``table`` as its packed layout table (and ``keys``' flattening)."""
    metadata = read_raw(path)
    planner_data = dict(metadata.planner_data or {})
    planner_data[PACKED_LAYOUT_KEY] = table
    for key in keys:
        planner_data[key] = tuple(key.split(".", 1))
    metadata.planner_data = planner_data
    (path / ".metadata").write_bytes(pickle.dumps(metadata))


def read_raw(path: Path) -> Metadata:
    metadata: Metadata = pickle.loads((path / ".metadata").read_bytes())
    return metadata


class CountingReader(MetadataReader):
    """A DCP reader over given metadata that counts what it is asked to read.

    Attributes:
        items: ``ReadItem`` count per stored key.
        bytes_read: Stored bytes deserialized (DCP's reader deserializes a whole stored item per ``ReadItem``).
    """

    def __init__(self, path: Path, metadata: Metadata) -> None:
        super().__init__(path, metadata)
        self.items: Counter[str] = Counter()
        self.bytes_read = 0

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        for item in plan.items:
            self.items[item.storage_index.fqn] += 1
            self.bytes_read += int(self.storage_data[item.storage_index].length)
        return super().read_data(plan, planner)
