"""Rank functions for checkpoints of models sharded by torch's engines (FSDP2, FSDP2 HSDP, FSDP1, DDP) and plain ones.

Each engine trains the same :class:`tests.models.ParityModel` on the same global batches, so a
checkpoint of one engine loads into another (and at another world size) and training goes on.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.nn.parallel import DistributedDataParallel

import shardline
import shardline.checkpoint as ckpt
from tests.checkpoint.ranks import catch
from tests.models import Block, ParityModel, batch, local_slice, loss_fn

ENGINES = ("fsdp2", "hsdp", "fsdp1", "ddp")
LR = 0.01


def build(engine: str, world: int, *, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The parity model sharded by ``engine`` over ``world`` ranks, and its AdamW."""
    torch.manual_seed(seed)
    model: nn.Module = ParityModel(n_blocks=2)
    if engine in ("fsdp2", "hsdp"):
        # hsdp: a genuine 2-D mesh, replicas x shard group (W=2: two replicas of one shard each).
        mesh = (
            init_device_mesh("cpu", (world,))
            if engine == "fsdp2"
            else init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
        )
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif engine == "fsdp1":
        model = FullyShardedDataParallel(
            model, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"), use_orig_params=True
        )
    elif engine == "ddp":
        model = DistributedDataParallel(model)
    elif engine != "plain":
        raise ValueError(engine)
    return model, torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95))


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int, rank: int, world: int) -> float:
    """One step on this rank's slice of the global batch of ``step``; the mean loss over ranks."""
    tokens, targets = batch(step)
    loss = loss_fn(model(local_slice(tokens, rank, world)), local_slice(targets, rank, world))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / world


def save_and_resume(rank: int, world: int, root: str, engines: list[str]) -> dict[str, Any]:
    """Per engine: train 2 steps, save, train 2 more (the reference); load into a fresh model, train the same 2.

    Returns ``{engine: {"reference": [...], "resumed": [...]}}`` (or ``{"error": ...}`` where the load failed).
    """
    out: dict[str, Any] = {}
    for engine in engines:
        model, optimizer = build(engine, world)
        losses = [train_step(model, optimizer, step, rank, world) for step in range(2)]
        path = os.path.join(root, engine)
        fresh, fresh_optimizer = build(engine, world, seed=123)
        try:  # an error is reported, so that one engine's failure does not hide the others'
            ckpt.save(path, model=model, optimizer=optimizer, step=2, state={"step": 2})
            reference = [train_step(model, optimizer, step, rank, world) for step in range(2, 4)]
            state = ckpt.load(path, model=fresh, optimizer=fresh_optimizer)
        except Exception as e:
            out[engine] = {"error": f"{type(e).__name__}: {e}", "first": losses}
            continue
        resumed = [train_step(fresh, fresh_optimizer, step, rank, world) for step in range(state["step"], 4)]
        out[engine] = {"reference": reference, "resumed": resumed, "first": losses}
    return out


def resume_elsewhere(rank: int, world: int, root: str, saved: list[str], into: list[str]) -> dict[str, Any]:
    """Load each checkpoint of ``saved`` into a model of each engine of ``into`` at this world size; train 2 steps.

    Also the damaged copy ``<root>/<engine>-damaged`` of each (one byte flipped by the test): the
    error its load raises. Last, a plain model's own save and resume at this world size (``save_and_resume``).
    """
    out: dict[str, Any] = {}
    for source in saved:
        for engine in into:
            model, optimizer = build(engine, world, seed=7)
            try:
                state = ckpt.load(os.path.join(root, source), model=model, optimizer=optimizer)
                losses = [train_step(model, optimizer, step, rank, world) for step in range(state["step"], 4)]
                out[f"{source}->{engine}"] = losses
            except Exception as e:
                out[f"{source}->{engine}"] = f"{type(e).__name__}: {e}"
        model, optimizer = build(into[0], world, seed=7)
        out[f"{source}-damaged"] = catch(
            ckpt.load, os.path.join(root, f"{source}-damaged"), model=model, optimizer=optimizer
        )
    out["plain"] = save_and_resume(rank, world, os.path.join(root, "one-rank"), ["plain"])["plain"]
    return out


def manager_round_trip(rank: int, world: int, directory: str, engine: str) -> tuple[list[float], list[float]]:
    """A CheckpointManager saves step 2 of ``engine`` and resumes it ("auto") into a fresh model."""
    model, optimizer = build(engine, world)
    with ckpt.CheckpointManager(directory) as manager:
        for step in range(2):
            train_step(model, optimizer, step, rank, world)
        manager.save(ckpt.SaveRequest(model=model, optimizer=optimizer, step=2, state={"step": 2}))
    reference = [train_step(model, optimizer, step, rank, world) for step in range(2, 4)]
    fresh, fresh_optimizer = build(engine, world, seed=5)
    state = ckpt.CheckpointManager(directory).load("auto", model=fresh, optimizer=fresh_optimizer)
    assert state is not None
    resumed = [train_step(fresh, fresh_optimizer, step, rank, world) for step in range(state["step"], 4)]
    return reference, resumed


def refused(rank: int, world: int, root: str) -> dict[str, tuple[str, str]]:
    """What ``save`` says about models it cannot handle: DDP inside a model, and mixed engines."""
    out: dict[str, tuple[str, str]] = {}
    inner = ParityModel(n_blocks=1)
    inner.blocks[0] = DistributedDataParallel(inner.blocks[0])  # type: ignore[assignment]
    out["nested_ddp"] = catch(ckpt.save, Path(root, "nested"), model=inner, step=1)
    torch.manual_seed(0)
    mixed = ParityModel(n_blocks=2)
    fully_shard(mixed.blocks[0], mesh=init_device_mesh("cpu", (world,)))
    shardline.wrap(mixed.blocks[1], shardline.layer_policy(nn.Linear))
    out["mixed"] = catch(ckpt.save, Path(root, "mixed"), model=mixed, step=1)
    return out


def flip_byte(directory: str, target: str) -> str:
    """Copy ``directory`` to ``target`` and flip one byte of its first shard file; return that file's name."""
    shutil.copytree(directory, target)
    shard = sorted(Path(target).glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    return shard.name
