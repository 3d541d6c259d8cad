"""Rank functions for the DCP-native writer and reader tests: a torchtitan-shaped state of Stateful objects over an
FSDP2 model, saved and loaded by ``torch.distributed.checkpoint`` itself with shardline's Writer and Reader."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import shardline.checkpoint as ckpt


class AppState(Stateful):
    """Model and optimizer as one Stateful (torchtitan's ModelWrapper/OptimizersContainer do the same)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        model, optim = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optimizer": optim}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(
            self.model, self.optimizer, model_state_dict=state_dict["model"], optim_state_dict=state_dict["optimizer"]
        )


class TrainState(Stateful):
    def __init__(self, step: int = 0) -> None:
        self.step = step

    def state_dict(self) -> dict[str, Any]:
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])


class Unpicklable(Stateful):
    """A rank's state that DCP cannot serialize: the write fails on that rank, inside DCP's write_data."""

    def state_dict(self) -> dict[str, Any]:
        return {"hook": lambda: None}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise AssertionError("never loaded")


def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    return model, optimizer


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    for step in range(steps):
        torch.manual_seed(100 + step * 7 + dist.get_rank())
        model(torch.randn(4, 8)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}


def _failures(error: CheckpointException) -> list[str]:
    return [f"{type(exc).__name__}: {exc}" for exc, _trace in error.failures.values()]


def save_and_load(rank: int, world: int, root: str) -> dict[str, Any]:
    """Save with dcp.save and dcp.async_save, fail a save on one rank, load back, and refuse a flipped byte."""
    ckpts = Path(root) / "checkpoints"
    model, optimizer = build(seed=0)
    train(model, optimizer, steps=2)
    state: dict[str, Any] = {"app": AppState(model, optimizer), "train_state": TrainState(step=1)}
    out: dict[str, Any] = {}

    writer = ckpt.Writer(ckpts / "step-1")
    dcp.save(state, storage_writer=writer)
    out["sync_info"] = writer.info

    train(model, optimizer, steps=1)
    state["train_state"].step = 2
    saved = full_params(model)
    writer = ckpt.Writer(ckpts / "step-2", config={"lr": 0.01})
    dcp.async_save(state, storage_writer=writer).result()
    out["async_info"] = writer.info

    # A write that fails on rank 1 only: nothing committed; the next save (of the same step) finds the name free
    # and leaves no in-progress directory behind.
    failing = {**state, "extra": Unpicklable()} if rank == 1 else dict(state)
    try:
        dcp.save(failing, storage_writer=ckpt.Writer(ckpts / "step-3"))
        out["failed_save"] = None
    except CheckpointException as e:
        out["failed_save"] = _failures(e)
    dist.barrier()
    out["after_failure"] = sorted(p.name for p in ckpts.iterdir() if not p.name.startswith("."))
    dcp.save(state, storage_writer=ckpt.Writer(ckpts / "step-3"))
    dist.barrier()
    out["after_retry"] = sorted(p.name for p in ckpts.iterdir())

    # Load into a model built from another seed, at the same world size: equal to what was saved.
    model2, optimizer2 = build(seed=1)
    state2: dict[str, Any] = {"app": AppState(model2, optimizer2), "train_state": TrainState()}
    reader = ckpt.Reader(ckpts / "step-2")
    dcp.load(state2, storage_reader=reader)
    loaded = full_params(model2)
    out["loaded_equal"] = sorted(saved) == sorted(loaded) and all(torch.equal(saved[k], loaded[k]) for k in saved)
    out["loaded_step"] = state2["train_state"].step
    out["reader_hash"] = reader.manifest_hash

    # A flipped byte in a copy: refused on every rank before anything is decoded (model3 keeps its values).
    flipped = Path(root) / "flipped" / "step-2"
    if rank == 0:
        shutil.copytree(ckpts / "step-2", flipped)
        victim = sorted(flipped.glob("__1_*.distcp"))[0]
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0x01
        victim.write_bytes(bytes(data))
    dist.barrier()
    model3, optimizer3 = build(seed=2)
    before = full_params(model3)
    state3: dict[str, Any] = {"app": AppState(model3, optimizer3), "train_state": TrainState()}
    try:
        dcp.load(state3, storage_reader=ckpt.Reader(flipped))
        out["flipped"] = None
    except CheckpointException as e:
        out["flipped"] = _failures(e)
    after = full_params(model3)
    out["untouched"] = all(torch.equal(before[k], after[k]) for k in before)
    out["flipped_step"] = state3["train_state"].step
    return out
