"""Rank functions for the ZeRO-1 / hybrid / partial-reshard checkpoint round trips (picklable by name)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

import shardline
import shardline.checkpoint as ckpt
from tests.checkpoint.ranks import CONFIG, pack, snapshot, train_step, trainer_state
from tests.models import Block, ParityModel


def build(strategy: str, *, seed: int = 0):
    """The parity model under ``strategy``; hybrid strategies get a (W/2, 2) mesh, full_shard partial resharding."""
    torch.manual_seed(seed)
    model = ParityModel()
    kwargs: dict = {}
    if strategy.startswith("hybrid"):
        kwargs["mesh"] = shardline.hybrid_mesh(shard_size=2)
    shardline.wrap(model, shardline.layer_policy(Block), strategy=strategy, **kwargs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=CONFIG["lr"], betas=tuple(CONFIG["betas"]))
    return model, optimizer


def train_and_save(rank: int, world: int, path: str, strategy: str, steps: int) -> bytes:
    model, optimizer = build(strategy)
    for step in range(steps):
        train_step(model, optimizer, step, rank, world)
    ckpt.save(path, model=model, optimizer=optimizer, state=trainer_state(steps), step=steps, config=CONFIG)
    return snapshot(model, optimizer)


def load_train_save(rank: int, world: int, source: str, target: str, strategy: str) -> tuple[bytes, bytes, dict]:
    """Load ``source`` into a differently seeded model, snapshot it, train one step, save ``target``, snapshot."""
    model, optimizer = build(strategy, seed=123)
    state = ckpt.load(source, model=model, optimizer=optimizer)
    loaded = snapshot(model, optimizer)
    step = state["step"]
    train_step(model, optimizer, step, rank, world)
    ckpt.save(target, model=model, optimizer=optimizer, state=trainer_state(step + 1), step=step + 1, config=CONFIG)
    manifest = json.loads((Path(target) / "manifest.json").read_text())
    return loaded, snapshot(model, optimizer), {"mesh": manifest["mesh"], "units": manifest["units"]}


def load_only(rank: int, world: int, path: str, strategy: str) -> bytes:
    model, optimizer = build(strategy, seed=7)
    ckpt.load(path, model=model, optimizer=optimizer)
    return snapshot(model, optimizer)


__all__ = ["build", "load_only", "load_train_save", "pack", "train_and_save"]
