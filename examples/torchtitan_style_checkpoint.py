"""A torchtitan-style checkpointer that saves and loads through torch.distributed.checkpoint itself, with
shardline's Writer and Reader: every checkpoint is hashed, manifested, committed atomically and in the ledger.

    torchrun --standalone --nproc-per-node 2 examples/torchtitan_style_checkpoint.py --out /tmp/titan

Then ``shardline lineage /tmp/titan/checkpoints`` and ``shardline verify /tmp/titan/checkpoints/step-4``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import shardline.checkpoint as ckpt


class ModelWrapper(Stateful):
    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return get_state_dict(self.model, [])[0]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(self.model, [], model_state_dict=state_dict, optim_state_dict={})


class OptimizerWrapper(Stateful):
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_state_dict(self.model, self.optimizer)[1]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict={}, optim_state_dict=state_dict)


class TrainState(Stateful):
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])


class Checkpointer:
    """What a trainer's checkpointer does: a dict of Stateful objects, dcp.save and dcp.load by step folder."""

    def __init__(self, folder: Path, states: dict[str, Stateful]) -> None:
        self.folder, self.states = folder, states
        self.parent: str | None = None  # the manifest hash this run descends from (set by a load)

    def save(self, step: int) -> None:
        writer = ckpt.Writer(self.folder / f"step-{step}", parent_manifest_hash=self.parent)
        dcp.save(self.states, storage_writer=writer)
        self.parent = None  # later saves chain to the newest checkpoint in the ledger
        if writer.info is not None:  # rank 0
            print(f"saved step {step}: manifest {writer.info.manifest_hash[:12]}, {writer.info.files} files")

    def load(self, step: int) -> None:
        reader = ckpt.Reader(self.folder / f"step-{step}")  # verifies every byte before anything is decoded
        dcp.load(self.states, storage_reader=reader)
        self.parent = reader.manifest_hash


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="run directory (checkpoints go in OUT/checkpoints)")
    parser.add_argument("--steps", type=int, default=4, help="training steps; a checkpoint every 2")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    model, optimizer = build()
    train_state = TrainState()
    states = {"model": ModelWrapper(model), "optimizer": OptimizerWrapper(model, optimizer), "train_state": train_state}
    checkpointer = Checkpointer(args.out / "checkpoints", states)
    for step in range(1, args.steps + 1):
        torch.manual_seed(step * 10 + dist.get_rank())
        loss = model(torch.randn(8, 16)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        train_state.step = step
        if step % 2 == 0:
            checkpointer.save(step)
    # Resume: fresh objects loaded from the newest checkpoint, verified first.
    model2, optimizer2 = build()
    resumed = TrainState()
    states2 = {"model": ModelWrapper(model2), "optimizer": OptimizerWrapper(model2, optimizer2), "train_state": resumed}
    Checkpointer(args.out / "checkpoints", states2).load(args.steps)
    pairs = zip(model.parameters(), model2.parameters(), strict=True)
    same = all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in pairs)
    if dist.get_rank() == 0:
        print(f"resumed at step {resumed.step}; parameters equal: {same}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
