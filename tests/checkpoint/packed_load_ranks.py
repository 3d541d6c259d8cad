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

import shardline.checkpoint as ckpt
from shardline.checkpoint.format.load_planner import ShardlineLoadPlanner
from shardline.checkpoint.format.packed_view import logical_metadata
from shardline.checkpoint.state.rng import restore_rng_state
from tests.checkpoint import packed_fixture as fx
from tests.checkpoint import ranks, zero_ranks


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


def save_both_layouts(rank: int, world: int, root: str) -> bytes:
    """Train two steps, save the same state per-tensor (``plain``) and packed (``packed``, small segments)."""
    model, optimizer = ranks.build("full_shard")
    for step in range(2):
        ranks.train_step(model, optimizer, step, rank, world)
    common: dict[str, Any] = {
        "model": model,
        "optimizer": optimizer,
        "state": ranks.trainer_state(2),
        "step": 2,
        "config": ranks.CONFIG,
    }
    ckpt.save(f"{root}/plain", **common)
    ckpt.save(f"{root}/packed", **common, layout="packed", segment_bytes=512)
    return ranks.snapshot(model, optimizer)


def load_both_layouts(rank: int, world: int, root: str) -> tuple[bytes, bytes, bytes, bytes]:
    """Load ``plain`` and ``packed`` into fresh models: (trainer state, snapshot) of each."""
    out = []
    for name in ("plain", "packed"):
        model, optimizer = ranks.build("full_shard", seed=123)
        state = ckpt.load(f"{root}/{name}", model=model, optimizer=optimizer)
        out += [ranks.pack(state), ranks.snapshot(model, optimizer)]
    return out[0], out[1], out[2], out[3]


def resume_losses(rank: int, world: int, root: str, layout: str) -> tuple[list[float], list[float]]:
    """Train 4 steps saving at step 2 in ``layout``; resume from step 2 and train to 4: (first run's losses, the
    resumed run's losses)."""
    directory = f"{root}/run-{layout}"
    model, optimizer = ranks.build()
    first = []
    with ckpt.CheckpointManager(directory, layout=layout, segment_bytes=512) as manager:
        for step in range(4):
            first.append(ranks.train_step(model, optimizer, step, rank, world))
            if step + 1 == 2:
                manager.save(
                    ckpt.SaveRequest(
                        step=2, model=model, optimizer=optimizer, state=ranks.trainer_state(2), config=ranks.CONFIG
                    )
                )
    model, optimizer = ranks.build(seed=99)
    manager = ckpt.CheckpointManager(directory)
    state = manager.load(f"{directory}/step-2", model=model, optimizer=optimizer)
    restore_rng_state(state["per_rank"]["rng"])
    resumed = [ranks.train_step(model, optimizer, step, rank, world) for step in range(state["step"], 4)]
    return first, resumed


def hybrid_to_full_shard(rank: int, world: int, root: str) -> tuple[bytes, bytes, bytes]:
    """Train a hybrid (W/2 x 2) model two steps and save it packed; load it into a hybrid and a full_shard model at
    the same world size: (trained, hybrid load, full_shard load) snapshots."""
    model, optimizer = zero_ranks.build("hybrid_shard")
    for step in range(2):
        ranks.train_step(model, optimizer, step, rank, world)
    path = f"{root}/hybrid-packed"
    ckpt.save(path, model=model, optimizer=optimizer, step=2, layout="packed", segment_bytes=512)
    out = [ranks.snapshot(model, optimizer)]
    for strategy in ("hybrid_shard", "full_shard"):
        loaded, loaded_optimizer = zero_ranks.build(strategy, seed=123)
        ckpt.load(path, model=loaded, optimizer=loaded_optimizer)
        out.append(ranks.snapshot(loaded, loaded_optimizer))
    return out[0], out[1], out[2]
