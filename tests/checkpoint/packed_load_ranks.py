"""Rank functions for tests/checkpoint/test_packed_load.py (module level, so the harness can pickle them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from shardline.checkpoint.format.load_planner import ShardlineLoadPlanner
from shardline.checkpoint.format.packed_view import logical_metadata
from tests.checkpoint import packed_fixture as fx


def load_pieces(rank: int, world: int, cases: dict[str, str]) -> dict[str, Any]:
    """Load each packed checkpoint of ``cases`` (name -> path) into DTensors placed as the name says (``shard``:
    Shard(0), ``replicate``: Replicate(), ``cols``: Shard(1)); per case, whether every local piece equals the full
    tensor's rows, the read items per stored key and the stored bytes deserialized (or the error)."""
    tensors = fx.full_tensors()
    mesh = init_device_mesh("cpu", (world,))
    out: dict[str, Any] = {}
    for name, path in cases.items():
        placement = {"shard": Shard(0), "replicate": Replicate(), "cols": Shard(1)}[name.split("-")[0]]
        targets = {}
        for key, full in tensors.items():
            place = placement if full.dim() > 1 or not isinstance(placement, Shard) or placement.dim == 0 else Shard(0)
            targets[key] = distribute_tensor(torch.full_like(full, 7.0), mesh, [place])
        reader = fx.CountingReader(Path(path), logical_metadata(fx.read_raw(Path(path))))
        try:
            dcp.load(fx._nested(targets), storage_reader=reader, planner=ShardlineLoadPlanner())
        except CheckpointException as e:
            failures = {type(exc).__name__ + ": " + str(exc) for exc, _ in e.failures.values()}
            untouched = all(bool((t.to_local() == 7.0).all()) for t in targets.values())
            out[name] = {"error": sorted(failures), "untouched": untouched}
            continue
        equal = {}
        for key, full in tensors.items():
            expected = distribute_tensor(full, mesh, [targets[key].placements[0]]).to_local()
            equal[key] = torch.equal(targets[key].to_local(), expected)
        out[name] = {"equal": equal, "items": dict(reader.items), "bytes": reader.bytes_read}
    dist.barrier()
    return out
