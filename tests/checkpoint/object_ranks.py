"""Rank functions of the object-store tests (module level, so the harness can pickle them by name).

Endpoint and credentials reach the ranks through the standard AWS environment (the harness's ``env``).
"""

from __future__ import annotations

import os
import signal

import shardline.checkpoint as ckpt
from shardline.errors import CheckpointError
from shardline.testing import KillAtPhase, SaveObserver, SavePhase
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


def manager_saves(
    rank: int,
    world: int,
    root: str,
    ledger: str,
    save_at: list[int],
    keep_last_n: int = 0,
    async_save: bool = False,
) -> tuple[list[str | None], bytes]:
    """Train, saving through a manager on ``root`` (a URL) at ``save_at``; ``latest`` after each save, and the
    state at the last save. Async: one more step is trained while the last save uploads (it must not leak in)."""
    model, optimizer = build()
    latest: list[str | None] = []
    saved = b""
    with ckpt.CheckpointManager(root, ledger_path=ledger, keep_last_n=keep_last_n, async_save=async_save) as manager:
        for step in range(max(save_at)):
            train_step(model, optimizer, step, rank, world)
            if step + 1 in save_at:
                request = ckpt.SaveRequest(
                    step=step + 1, model=model, optimizer=optimizer, state=trainer_state(step + 1), config=CONFIG
                )
                manager.save(request)
                saved = snapshot(model, optimizer)
                manager.wait()
                found = manager.latest()
                latest.append(str(found) if found is not None else None)
        if async_save:
            manager.save(
                ckpt.SaveRequest(
                    step=max(save_at) + 1, model=model, optimizer=optimizer, state=trainer_state(max(save_at) + 1)
                )
            )
            saved = snapshot(model, optimizer)
            train_step(model, optimizer, max(save_at) + 1, rank, world)  # while the upload runs
    return latest, saved


def manager_resume_state(rank: int, world: int, root: str, ledger: str) -> tuple[int, bytes]:
    """``load("auto")`` through a manager on ``root`` into a freshly built model: the step and the loaded state."""
    model, optimizer = build(seed=7)
    with ckpt.CheckpointManager(root, ledger_path=ledger) as manager:
        state = manager.load("auto", model=model, optimizer=optimizer)
    return int(state["step"]) if state else -1, snapshot(model, optimizer)


def try_manager_save(rank: int, world: int, root: str, ledger: str, options: dict, async_save: bool) -> tuple[str, str]:
    """One save through a manager with ``options`` (e.g. credentials that may not write): the error it ends with."""
    model, optimizer = build()

    def save_and_wait() -> None:
        manager = ckpt.CheckpointManager(root, ledger_path=ledger, storage_options=options, async_save=async_save)
        try:
            manager.save(ckpt.SaveRequest(step=1, model=model, optimizer=optimizer, state=trainer_state(1)))
        finally:
            manager.close()

    return catch(save_and_wait)


def manager_resume_auto(rank: int, world: int, root: str, ledger: str) -> tuple[str, str]:
    """``load("auto")`` through a manager on ``root``: ``("ok", step)`` or the error's (class name, message)."""
    model, optimizer = build(seed=7)
    manager = ckpt.CheckpointManager(root, ledger_path=ledger)
    try:
        state = manager.load("auto", model=model, optimizer=optimizer)
    except CheckpointError as e:
        return type(e).__name__, str(e)
    return "ok", str(None if state is None else state["step"])


def save_strays(rank: int, world: int, paths: list[str]) -> list[str]:
    """Save a checkpoint at each of ``paths`` (``.../step-N``) with the library's ``save`` (no manager, no ledger):
    checkpoints a run's ledger does not know. Their manifest hashes."""
    model, optimizer = build()
    saved: list[str] = []
    for path in paths:
        step = int(path.rsplit("step-", 1)[1])
        train_step(model, optimizer, step, rank, world)
        saved.append(ckpt.save(path, model=model, optimizer=optimizer, step=step, config=CONFIG).manifest_hash)
    return saved


def race_to_save(rank: int, world: int, roots: list[str]) -> list[tuple[str, str, str]]:
    """Each rank is a run of its own (a one-rank group) saving step-1 into the same prefixes, started together.

    Returns, per prefix, (error class or "ok", message, manifest hash of what this rank committed or "").
    """
    import torch.distributed as dist

    groups = [dist.new_group([r], backend="gloo") for r in range(world)]  # collective: every rank creates each
    model, optimizer = build(seed=rank)  # different weights: the committed checkpoint says whose it is
    train_step(model, optimizer, 0, 0, 1)
    out: list[tuple[str, str, str]] = []
    for root in roots:
        dist.barrier()
        try:
            info = ckpt.save(
                f"{root}/step-1", model=model, optimizer=optimizer, step=1, process_group=groups[rank], config=CONFIG
            )
        except CheckpointError as e:
            out.append((type(e).__name__, str(e), ""))
        else:
            out.append(("ok", "", info.manifest_hash))
    return out


def writer_saves(rank: int, world: int, url: str, ledger: str) -> dict[str, float]:
    """``dcp.save`` through shardline's DCP-native ``Writer`` into ``url``, then ``dcp.load`` through ``Reader``:
    each rank's own tensor, as loaded back."""
    import torch
    import torch.distributed.checkpoint as dcp

    state = {f"rank{rank}": torch.full((64,), float(rank + 1))}
    dcp.save(state, storage_writer=ckpt.Writer(url, ledger_path=ledger))
    loaded = {f"rank{rank}": torch.zeros(64)}
    dcp.load(loaded, storage_reader=ckpt.Reader(url))
    return {name: float(t.sum()) for name, t in loaded.items()}
