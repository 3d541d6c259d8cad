"""Rank functions of the fault-injection tests (module level, so the harness can pickle them by name)."""

from __future__ import annotations

from typing import Any

import shardline.checkpoint as ckpt
from shardline.checkpoint.faults.fault import FailWrites
from shardline.checkpoint.integrity.manifest import read_manifest
from shardline.checkpoint.state.rng import restore_rng_state
from tests.checkpoint import ranks


def load_each(rank: int, world: int, paths: list[str], expected: dict[str, str]) -> dict[str, tuple[str, str]]:
    """Load every (damaged) checkpoint in ``paths``; ``(error type, message)`` for each, the same on every rank."""
    model, optimizer = ranks.build(seed=123)
    return {
        p: ranks.catch(ckpt.load, p, model=model, optimizer=optimizer, expected_manifest_hash=expected.get(p))
        for p in paths
    }


def _request(model: Any, optimizer: Any, step: int) -> ckpt.SaveRequest:
    return ckpt.SaveRequest(step=step, model=model, optimizer=optimizer, state=ranks.trainer_state(step))


def resume_over_damage(rank: int, world: int, directory: str) -> dict[str, Any]:
    """``load("auto")`` over a damaged newest checkpoint, then train to step 6 saving at 4 and 6; then a
    second manager loads step 6 with the ``sizes`` opt-in."""
    model, optimizer = ranks.build(seed=99)
    manager = ckpt.CheckpointManager(directory)
    state = manager.load("auto", model=model, optimizer=optimizer)
    restore_rng_state(state["per_rank"]["rng"])
    start, losses = state["step"], []
    for step in range(start, 6):
        losses.append(ranks.train_step(model, optimizer, step, rank, world))
        if step + 1 in (4, 6):
            manager.save(_request(model, optimizer, step + 1))  # step 4 must not collide with the damaged one
    out = {
        "start": start,
        "losses": losses,
        "moved": [p.name for p in manager.moved_aside],
        "parent_of_4": read_manifest(manager.path_for(4))[0]["parent_manifest_sha256"],
    }
    again = ckpt.CheckpointManager(directory)
    again.load("auto", model=model, optimizer=optimizer, verify="sizes")
    out["sizes_resumed_from"] = again.resumed_from.name if again.resumed_from else None
    return out


def disk_full(rank: int, world: int, directory: str, async_save: bool) -> tuple[str, str]:
    """Save step 1, then save step 2 while rank 1's writes fail with ENOSPC; the error every rank sees."""
    model, optimizer = ranks.build()
    manager = ckpt.CheckpointManager(directory, async_save=async_save)
    ranks.train_step(model, optimizer, 0, rank, world)
    manager.save(_request(model, optimizer, 1))
    manager.wait()
    manager.observer = FailWrites(ranks={1}, after_bytes=1000)
    ranks.train_step(model, optimizer, 1, rank, world)
    try:
        manager.save(_request(model, optimizer, 2))
        manager.close()
    except Exception as e:
        return type(e).__name__, str(e)
    return "no error", ""


def resume_each(rank: int, world: int, directories: list[str]) -> dict[str, tuple[int | None, list[str]]]:
    """``load("auto")`` in each directory: the step resumed and what was moved aside."""
    model, optimizer = ranks.build(seed=7)
    out = {}
    for directory in directories:
        manager = ckpt.CheckpointManager(directory)
        state = manager.load("auto", model=model, optimizer=optimizer)
        out[directory] = ((state or {}).get("step"), [p.name for p in manager.moved_aside])
    return out
