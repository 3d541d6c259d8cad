"""The packed layout's planning at W ranks (``scale_sim.py --layout packed``), with the save planner's own code.

Rank 0's DTensors are real ones on the meta device (no data) over a W-rank mesh of torch's fake
process group, so the planner runs as in a save: :meth:`PackedSave.build` (the table from the
state dict, rank 0's rows checked, its segments), ``ShardlineSavePlanner.create_local_plan`` (one
rank's local plan), then rank 0's ``create_global_plan`` over every rank's plan -- DCP's dedup,
global plan and metadata, shardline's plan check with the packed check (every rank's table digest,
every planned segment against ``expected_segment_sizes``), the table into ``planner_data`` -- and
``.metadata`` as ``FileSystemWriter.finish`` pickles it, unpickled as every rank opens it. Each other
rank's plan is what it sends: its segment items (``segment_write_item``, sizes from the table) and
its digest. Every tensor is planned (nothing is sampled: packed plans are O(W + tensors)).

Then what rank 0 gathers at the end of the save (every rank's DCP write results for its segments and
its ``files`` data files' digest records, pickled as DCP's ``gather_object`` sends them), and a load at
the same W by a rank in the middle of the world: the logical view of the checkpoint's ``.metadata``
(``packed_view.logical_metadata``: the table checked against the stored segments) and
``ShardlineLoadPlanner``'s plan into that rank's DTensors (one read per segment it needs).
"""

from __future__ import annotations

import contextlib
import dataclasses
import pickle
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from benchmarks.scale_layout import Tensor, fake_sha256, file_bytes, rank_rows
from shardline.checkpoint.coordination.parallelism import AUTO
from shardline.checkpoint.format.dcp_io import unpickle_metadata
from shardline.checkpoint.format.load_planner import ShardlineLoadPlanner
from shardline.checkpoint.format.packed_layout import DEFAULT_SEGMENT_BYTES
from shardline.checkpoint.format.packed_view import logical_metadata
from shardline.checkpoint.integrity.hashing import FileDigest
from shardline.checkpoint.integrity.hashing_writer import digest_result
from shardline.checkpoint.integrity.manifest import DCP_METADATA
from shardline.checkpoint.integrity.packed_plan import (
    PLAN_DIGEST_KEY,
    PackedSave,
    check_packed_plan,
    segment_write_item,
    table_digest,
)
from shardline.checkpoint.integrity.plan_validation import ShardlineSavePlanner

__all__ = ["PACKED_COLUMNS", "packed_costs"]

Timed = Callable[[Callable[[], Any], int], tuple[float, Any]]


@contextlib.contextmanager
def fake_world(world: int, rank: int = 0) -> Iterator[None]:
    """This process as ``rank`` of a ``world``-rank fake process group (collectives do nothing)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("the packed simulation needs a process without a process group")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _state_dict(tensors: list[Tensor], world: int, rank: int = 0) -> dict[str, DTensor]:
    """``rank``'s FULL_SHARD DTensors of ``tensors`` (its ``Shard(0)`` rows, on the meta device)."""
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for t in tensors:
        _, rows = rank_rows(t.shape[0], world, rank)
        local = torch.empty((rows, *t.shape[1:]), device="meta")
        shape = torch.Size(t.shape)
        stride = torch.empty(shape, device="meta").stride()
        out[t.key] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=shape, stride=stride)
    return out


def _plans(sizes: dict[str, int], world: int, digest: str) -> list[SavePlan]:
    """Every rank's local plan as it sends it: its segments' items (by the table's sizes) and its table's digest."""
    items: list[list[Any]] = [[] for _ in range(world)]
    for key, numel in sizes.items():
        rank, dtype = key.split(".")[1:3]
        items[int(rank[1:])].append(segment_write_item(key, numel, dtype))
    return [SavePlan(i, planner_data={PLAN_DIGEST_KEY: digest}) for i in items]


def packed_costs(
    world: int,
    tensors: list[Tensor],
    *,
    timed: Timed,
    reps: int,
    files: int = 8,
    segment_bytes: int = DEFAULT_SEGMENT_BYTES,
) -> dict[str, float]:
    """The packed layout's planning costs and ``.metadata`` at ``world`` ranks (see the module note)."""
    v: dict[str, float] = {}
    with fake_world(world):
        state = _state_dict(tensors, world)
        v["packed_table_build_s"], packed = timed(
            lambda: PackedSave.build(state, rank=0, world_size=world, segment_bytes=segment_bytes, files_per_rank=AUTO),
            reps,
        )

        def local_plan() -> ShardlineSavePlanner:
            planner = ShardlineSavePlanner(layout="packed", segment_bytes=segment_bytes, files_per_rank=AUTO)
            planner.set_up_planner(state, is_coordinator=True)
            planner.create_local_plan()
            return planner

        v["packed_local_plan_s"], planner = timed(local_plan, reps)
    layout = packed.layout
    plans = _plans(layout.expected_segment_sizes(), world, table_digest(layout))
    v["packed_global_plan_s"], (global_plan, metadata) = timed(lambda: planner.create_global_plan(plans), 1)
    v["packed_plan_check_s"], errors = timed(lambda: check_packed_plan(layout, global_plan, metadata), 1)
    assert not errors, errors[:3]

    def finish() -> bytes:  # FileSystemWriter.finish: each item's place in its rank's file, then the pickle
        storage: dict[MetadataIndex, Any] = {}
        for rank, plan in enumerate(global_plan):
            offset = 0
            for item in plan.items:
                assert item.tensor_data is not None
                length = item.tensor_data.chunk.sizes[0] * item.tensor_data.properties.dtype.itemsize
                storage[item.index] = _StorageInfo(relative_path=f"__{rank}_0.distcp", offset=offset, length=length)
                offset += length
        return pickle.dumps(dataclasses.replace(metadata, storage_data=storage))

    v["packed_finish_s"], data = timed(finish, 1)
    v["packed_metadata_bytes"] = len(data)
    v["packed_metadata_items"] = len(metadata.state_dict_metadata)
    v["packed_gathered_bytes"] = _gathered_bytes(global_plan, tensors, world, files)
    v["packed_metadata_open_per_rank_s"], opened = timed(lambda: unpickle_metadata(data, DCP_METADATA), reps)
    v["packed_view_per_rank_s"], view = timed(lambda: logical_metadata(opened), reps)
    mid = world // 2
    with fake_world(world, rank=mid):
        target = _state_dict(tensors, world, rank=mid)

        def load_plan() -> int:
            planner = ShardlineLoadPlanner(rank=mid)
            planner.set_up_planner(target, view)
            return len(planner.create_local_plan().items)

        v["packed_load_plan_per_rank_s"], reads = timed(load_plan, reps)
    v["packed_reads_per_rank"] = reads
    return v


def _gathered_bytes(global_plan: list[SavePlan], tensors: list[Tensor], world: int, files: int) -> int:
    """What DCP's ``gather_object`` brings rank 0 at the end of a packed save: each rank's write results (one per
    segment) and the digest records of its ``files`` data files, pickled per rank."""
    total = 0
    for rank, plan in enumerate(global_plan):
        results: list[Any] = []
        offset = 0
        for item in plan.items:
            assert item.tensor_data is not None
            length = item.tensor_data.chunk.sizes[0] * item.tensor_data.properties.dtype.itemsize
            info = _StorageInfo(relative_path=f"__{rank}_0.distcp", offset=offset, length=length)
            results.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=info))
            offset += length
        sizes = file_bytes(tensors, world, rank, files)
        for k, size in enumerate(sizes):
            name = f"__{rank}_{k}.distcp"
            results.append(digest_result(FileDigest(name, rank, size, fake_sha256(name))))
        total += len(pickle.dumps(results))
    return total


PACKED_COLUMNS = [
    ("world", "W", "{:,.0f}"),
    ("packed_table_build_s", "rank-0 table build (s)", "{:.3f}"),
    ("packed_local_plan_s", "local plan per rank (s)", "{:.3f}"),
    ("packed_global_plan_s", "rank-0 global plan + metadata + check (s)", "{:.3f}"),
    ("packed_plan_check_s", "of which the packed check (s)", "{:.3f}"),
    ("packed_finish_s", "DCP finish (s)", "{:.3f}"),
    ("packed_metadata_items", ".metadata items", "{:,.0f}"),
    ("packed_metadata_bytes", ".metadata", "bytes"),
    ("packed_gathered_bytes", "gathered to rank 0", "bytes"),
    ("packed_metadata_open_per_rank_s", "open .metadata per rank (s)", "{:.4f}"),
    ("packed_view_per_rank_s", "logical view per rank (s)", "{:.3f}"),
    ("packed_load_plan_per_rank_s", "load plan per rank (s)", "{:.3f}"),
    ("packed_reads_per_rank", "reads per rank", "{:,.0f}"),
    ("dcp_global_plan_s", "per-tensor: DCP global plan (s) *", "{:.1f}"),
    ("shardline_validate_s", "per-tensor: plan validation (s) *", "{:.2f}"),
    ("dcp_finish_s", "per-tensor: DCP finish (s) *", "{:.1f}"),
    ("dcp_metadata_bytes", "per-tensor: .metadata *", "bytes"),
    ("gathered_bytes", "per-tensor: gathered to rank 0 *", "bytes"),
]
"""The packed layout's columns, beside the per-tensor layout's counterparts (``*``: scaled from sampled tensors)."""
