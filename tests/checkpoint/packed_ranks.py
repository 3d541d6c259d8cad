"""Rank functions of the packed-layout save tests (tests/checkpoint/test_packed_save.py): one launch, many saves."""

from __future__ import annotations

import dataclasses
import os
import threading
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.tensor import DTensor

import shardline.checkpoint as ckpt
from shardline.checkpoint.faults.observer import NO_OBSERVER, SaveObserver
from shardline.checkpoint.format.packed_layout import is_segment_key
from shardline.checkpoint.integrity.packed_plan import PLAN_DIGEST_KEY
from shardline.checkpoint.integrity.plan_validation import ShardlineSavePlanner
from shardline.checkpoint.lifecycle.capture import SaveRequest, capture
from tests.checkpoint.ranks import build, catch, pack, train_step


def _locals(model: Any, optimizer: Any) -> list[tuple[str, str, bytes]]:
    """``(flat key, dtype, this rank's local rows as bytes)`` of every DTensor of the save, in flattened key order."""
    captured = capture(SaveRequest(model=model, optimizer=optimizer, step=0), path="unused")
    flat, _ = flatten_state_dict(captured.state_dict)
    out = []
    for key, value in flat.items():
        if isinstance(value, DTensor):
            local = value.to_local().detach().contiguous().reshape(-1)
            out.append((key, str(value.dtype).removeprefix("torch."), pack(local.clone())))
    return out


class _Hold(SaveObserver):
    def __init__(self) -> None:
        self.release = threading.Event()

    def before_write(self, path: str, nbytes: int, rank: int) -> None:
        assert self.release.wait(60), "the test never released the writer"


def _altered(what: str, victim: int) -> Any:
    """A ``create_local_plan`` that alters rank ``victim``'s plan: its table digest, or one segment's size."""
    real = ShardlineSavePlanner.create_local_plan

    def create_local_plan(self: ShardlineSavePlanner) -> SavePlan:
        plan = real(self)
        if torch.distributed.get_rank() != victim:
            return plan
        if what == "digest":
            data = {**plan.planner_data, PLAN_DIGEST_KEY: "0" * 64}
            self.plan = dataclasses.replace(plan, planner_data=data)
            return self.plan
        items = list(plan.items)
        i = next(i for i, item in enumerate(items) if is_segment_key(item.index.fqn))
        data = items[i].tensor_data
        assert data is not None
        grown = torch.Size([data.size[0] + 1])
        data = dataclasses.replace(data, size=grown, chunk=dataclasses.replace(data.chunk, sizes=grown))
        items[i] = dataclasses.replace(items[i], tensor_data=data)
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    return create_local_plan


def _uneven_rows(rank: int, world: int, path: str) -> str:
    """A DTensor whose rank 0 holds 3 of its 4 rows (torch.chunk gives 2): the packed save fails on every rank."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh("cpu", (world,))
    local = torch.ones(3 if rank == 0 else 2, 2)  # rank 1 holds what the rule gives it
    uneven = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size([4, 2]), stride=(2, 1))
    try:
        torch.distributed.checkpoint.save(
            {"w": uneven}, storage_writer=FileSystemWriter(path), planner=ShardlineSavePlanner(layout="packed")
        )
    except CheckpointException as e:
        return str(e)
    return "no error"


def packed_saves(rank: int, world: int, root: str) -> dict[str, Any]:
    """Every packed save the tests read back: sync, small segments, two files per rank, async (and a torn async one), injected plan
    faults, and a replicated (no_shard) model. Returns this rank's facts and local pieces."""
    out: dict[str, Any] = {}
    model, optimizer = build("full_shard")
    train_step(model, optimizer, 0, rank, world)
    out["locals"] = _locals(model, optimizer)
    ckpt.save(os.path.join(root, "packed"), model=model, optimizer=optimizer, step=1, layout="packed")
    ckpt.save(
        os.path.join(root, "small"), model=model, optimizer=optimizer, step=1, layout="segments", segment_bytes=64
    )
    ckpt.save(os.path.join(root, "spread"), model=model, optimizer=optimizer, step=1, layout="packed", files_per_rank=2)

    manager = ckpt.CheckpointManager(os.path.join(root, "async"), async_save=True, layout="packed")
    manager.save(SaveRequest(model=model, optimizer=optimizer, step=1))
    out["async_info"] = manager.wait() is not None
    hold = _Hold()
    manager.observer = hold
    manager.save(SaveRequest(model=model, optimizer=optimizer, step=2))  # staged; the write waits for the release
    buffers = manager.staging_buffers
    assert buffers is not None
    largest = max(buffers.buffers, key=lambda b: b.numel())
    largest.add_(1.0)  # a staged piece changes before it is written: a torn write
    hold.release.set()
    out["torn"] = catch(manager.wait)
    manager.observer = NO_OBSERVER
    manager.close()

    real = ShardlineSavePlanner.create_local_plan
    for what in ("digest", "size"):
        ShardlineSavePlanner.create_local_plan = _altered(what, victim=1)  # type: ignore[method-assign]
        try:
            path = os.path.join(root, f"altered-{what}")
            out[f"altered_{what}"] = catch(ckpt.save, path, model=model, optimizer=optimizer, step=1, layout="packed")
        finally:
            ShardlineSavePlanner.create_local_plan = real  # type: ignore[method-assign]

    replicated, replicated_optimizer = build("no_shard")
    train_step(replicated, replicated_optimizer, 0, rank, world)
    out["replicated_locals"] = _locals(replicated, replicated_optimizer)
    ckpt.save(
        os.path.join(root, "replicated"), model=replicated, optimizer=replicated_optimizer, step=1, layout="packed"
    )
    out["uneven_rows"] = _uneven_rows(rank, world, os.path.join(root, "uneven"))
    out["full_refused"] = catch(
        ckpt.save, os.path.join(root, "full"), model=model, optimizer=optimizer, step=1, kind="full", layout="packed"
    )
    return out
