"""The committed format fixture ``tests/fixtures/checkpoint-v1``: how it was written, and the model it fits.

The fixture is a checkpoint directory as a two-rank ``CheckpointManager`` wrote it (``step-2``,
``latest``, ``lineage.sqlite`` and its head record) after two training steps of a small model
with AdamW, plus ``expected.safetensors``: the full model and optimizer state the writing ranks
held when they saved (taken independently of the checkpoint, through ``full_state_dict``).
``test_format_fixture.py`` loads it with today's code; the directory itself is never rewritten
by a test. Regenerate it only for a deliberate format change (and say so in the change)::

    PYTHONPATH=src:. python -m tests.checkpoint.format_fixture
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

import shardline
import shardline.checkpoint as ckpt
from tests.checkpoint.ranks import pack, unpack
from tests.models import Block, batch, local_slice, loss_fn

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "checkpoint-v1"
EXPECTED = "expected.safetensors"
STEP = 2
CONFIG = {"model": "format-fixture", "lr": 0.01, "steps": STEP}
TRAINER_STATE = {"step": STEP, "data": {"epoch": 0, "position": 24}}


class FixtureModel(torch.nn.Module):
    """An embedding and one block of the parity model's kind (uneven shapes, a frozen parameter)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(13, 10)
        self.block = Block()
        self.head = torch.nn.Linear(10, 13, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.emb(tokens)))


def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The fixture's model, sharded (full_shard), and its optimizer; ``seed`` sets the initial values."""
    torch.manual_seed(seed)
    model = FixtureModel()
    shardline.wrap(model, shardline.layer_policy(Block), strategy="full_shard")
    optimizer = torch.optim.AdamW(model.parameters(), lr=CONFIG["lr"])
    return model, optimizer


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of the full model and optimizer state, flat (``model/<fqn>``, ``optim/<fqn>/<key>``); rank 0."""
    out: dict[str, torch.Tensor] = {}
    for name, value in shardline.full_state_dict(model, rank0_only=True).items():
        out[f"model/{name}"] = value.detach().clone().contiguous()
    optim = ckpt.optimizer_state_dict(model, optimizer, kind="full")
    for fqn, entry in optim.get("state", {}).items():  # rank 0 alone holds the full state
        for key, value in entry.items():
            out[f"optim/{fqn}/{key}"] = torch.as_tensor(value).detach().clone().contiguous()
    return out


def write(rank: int, world: int, directory: str) -> bytes | None:
    """Rank function: train two steps, save ``step-2`` through a manager; rank 0 returns the full state (packed)."""
    model, optimizer = build(seed=0)
    for step in range(STEP):
        tokens, targets = batch(step)
        loss = loss_fn(model(local_slice(tokens, rank, world)), local_slice(targets, rank, world))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    with ckpt.CheckpointManager(directory, files_per_rank=1) as manager:
        manager.save(
            ckpt.SaveRequest(
                step=STEP,
                model=model,
                optimizer=optimizer,
                state=TRAINER_STATE,
                config=CONFIG,
                data_fingerprint="format-fixture-v1",
            )
        )
    state = full_state(model, optimizer)
    return pack(state) if rank == 0 else None


def main() -> None:
    from shardline.testing import run_distributed

    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "checkpoint-v1"
        state = unpack(run_distributed(write, 2, args=(str(directory),))[0])
        save_file(state, str(directory / EXPECTED))
        if FIXTURE.exists():
            shutil.rmtree(FIXTURE)
        shutil.copytree(directory, FIXTURE)
    print(f"wrote {FIXTURE}: {sorted(p.name for p in FIXTURE.iterdir())}")


if __name__ == "__main__":
    main()
