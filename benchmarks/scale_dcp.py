"""DCP's view of the simulated ranks, for ``benchmarks/scale_sim.py``: each rank's save plan (one SHARD item per
tensor), the write results ``FileSystemWriter`` reports for it, and a rank's piece of a tensor as DCP's load planners
see one. No process group, no data.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from benchmarks.scale_layout import Tensor, rank_rows

__all__ = ["Piece", "item_results", "local_save_plan", "rank_chunk"]


class Piece(torch.Tensor):
    """A rank's piece of a tensor as DCP's load planners see one (its global size and, as a DTensor answers
    ``__create_chunk_list__``, its box), holding no data."""

    shape_: torch.Size
    box: ChunkStorageMetadata

    @staticmethod
    def __new__(cls, shape: tuple[int, ...], box: ChunkStorageMetadata) -> Piece:
        piece = torch.Tensor._make_subclass(cls, torch.empty(0))
        piece.shape_, piece.box = torch.Size(shape), box
        return piece

    def size(self, dim: int | None = None) -> Any:  # type: ignore[override]
        return self.shape_ if dim is None else self.shape_[dim]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [self.box]


def rank_chunk(t: Tensor, world: int, rank: int) -> ChunkStorageMetadata:
    """Rank ``rank``'s box of ``t``: its rows of the first dimension (FULL_SHARD), every other dimension whole."""
    start, rows = rank_rows(t.shape[0], world, rank)
    offsets = torch.Size([start, *([0] * (len(t.shape) - 1))])
    return ChunkStorageMetadata(offsets=offsets, sizes=torch.Size([rows, *t.shape[1:]]))


def local_save_plan(tensors: list[Tensor], world: int, rank: int) -> SavePlan:
    """Rank ``rank``'s DCP save plan: one SHARD item per tensor (its DTensor piece), as DCP's planner builds it."""
    items = []
    props = TensorProperties(dtype=torch.float32)
    for t in tensors:
        chunk = rank_chunk(t, world, rank)
        data = TensorWriteData(chunk=chunk, properties=props, size=torch.Size(t.shape))
        items.append(WriteItem(index=MetadataIndex(t.key, chunk.offsets), type=WriteItemType.SHARD, tensor_data=data))
    return SavePlan(items, planner_data={})


def item_results(plan: SavePlan, rank: int, files: int, t: Tensor | None = None) -> list[WriteResult]:
    """DCP's write results of a rank's plan: each item in one of its files, as ``FileSystemWriter`` reports them."""
    out = []
    offset = [0] * files
    for n, item in enumerate(plan.items):
        assert item.tensor_data is not None
        length = math.prod(item.tensor_data.chunk.sizes) * 4
        k = n % files
        info = _StorageInfo(relative_path=f"__{rank}_{k}.distcp", offset=offset[k], length=length)
        offset[k] += length
        out.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=info))
    return out
