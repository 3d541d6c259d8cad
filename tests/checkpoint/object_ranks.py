"""Rank functions of the object-store tests (module level, so the harness can pickle them by name).

Endpoint and credentials reach the ranks through the standard AWS environment (the harness's ``env``).
"""

from __future__ import annotations

import os
import signal

import shardline.checkpoint as ckpt
from shardline.checkpoint import SaveObserver, SavePhase
from shardline.checkpoint.faults.fault import KillAtPhase
from tests.checkpoint.ranks import CONFIG, build, catch, snapshot, train_step, trainer_state


def save_then_die(rank: int, world: int, root: str, victim: int) -> None:
    """Commit ``root/step-1``; then save ``root/step-2``, during which rank ``victim`` dies before the manifest."""
    model, optimizer = build()
    train_step(model, optimizer, 0, rank, world)
    info = ckpt.save(f"{root}/step-1", model=model, optimizer=optimizer, state=trainer_state(1), step=1, config=CONFIG)
    train_step(model, optimizer, 1, rank, world)
    ckpt.save(
        f"{root}/step-2",
        model=model,
        optimizer=optimizer,
        state=trainer_state(2),
        step=2,
        config=CONFIG,
        parent_manifest_hash=info.manifest_hash,
        observer=KillAtPhase("before_manifest", ranks={victim}),
        files_per_rank=2,
    )


def load_step(rank: int, world: int, path: str) -> tuple[int, bytes]:
    """Load ``path`` into a freshly built model (another seed); its step and the loaded state."""
    model, optimizer = build(seed=7)
    state = ckpt.load(path, model=model, optimizer=optimizer)
    return int(state["step"]), snapshot(model, optimizer)


def try_load(rank: int, world: int, path: str) -> tuple[str, str]:
    model, optimizer = build(seed=7)
    return catch(ckpt.load, path, model=model, optimizer=optimizer)


def try_save(rank: int, world: int, path: str, options: dict | None) -> tuple[str, str]:
    model, optimizer = build()
    return catch(ckpt.save, path, model=model, optimizer=optimizer, step=1, storage_options=options)


class _StopServer(SaveObserver):
    """Kill the S3 server (its whole process group) once rank 0 has written its shards."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def on_phase(self, phase: SavePhase, rank: int) -> None:
        if phase == SavePhase.AFTER_SHARDS and rank == 0:
            os.killpg(self.pid, signal.SIGKILL)


def save_then_lose_store(rank: int, world: int, root: str, server_pid: int) -> tuple[str, str]:
    """Commit ``root/step-1``; the server dies during the save of ``root/step-2``: that save's error."""
    model, optimizer = build()
    train_step(model, optimizer, 0, rank, world)
    ckpt.save(f"{root}/step-1", model=model, optimizer=optimizer, state=trainer_state(1), step=1, config=CONFIG)
    train_step(model, optimizer, 1, rank, world)
    return catch(
        ckpt.save,
        f"{root}/step-2",
        model=model,
        optimizer=optimizer,
        state=trainer_state(2),
        step=2,
        config=CONFIG,
        observer=_StopServer(server_pid),
    )
