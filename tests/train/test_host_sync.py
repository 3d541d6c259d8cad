"""No host read inside a training step; a non-finite step never reaches the weights or the optimizer state.

On a GPU every host read of a device tensor (``.item()``, ``float()``, ``bool()``, ``.tolist()``)
waits for the device to drain. The trainer reads a step's loss and gradient norm only at the end
of its read interval; these tests count the reads on the CPU, where the same calls are made.
"""

from __future__ import annotations

import contextlib
import math
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from shardline.distributed import init_distributed
from shardline.testing import run_distributed
from shardline.train.build import build_policies
from shardline.train.checkpointing import TrainingDiverged
from shardline.train.config import compose_config, to_train_config
from shardline.train.trainer import Trainer

STEPS = 4
OVERRIDES = [
    f"trainer.max_steps={STEPS}",
    f"trainer.log_every_n_steps={STEPS}",  # one read interval: steps 1-4
    f"trainer.val_check_interval={STEPS}",
    "trainer.val_batches=1",
    "trainer.micro_batch_size=2",
    "trainer.accumulate_grad_batches=2",
    "trainer.gradient_clip_val=1.0",
    "data.max_bytes=50000",
    "data.seq_len=16",
    "model.dim=32",
    "model.n_layers=2",
    "checkpoint.save_last=false",
    "checkpoint.save_on_exception=false",
]
# Every way Python code turns a tensor into a host value.
_READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__")


@contextlib.contextmanager
def host_reads() -> Iterator[Counter]:
    """Count the host reads of tensors made inside the block, by kind."""
    seen: Counter = Counter()
    originals = {name: getattr(torch.Tensor, name) for name in _READS}

    def spy(name: str) -> Any:
        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            seen[name] += 1
            return originals[name](self, *args, **kwargs)

        return read

    for name in _READS:
        setattr(torch.Tensor, name, spy(name))
    try:
        yield seen
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)


def _trainer(run_dir: str, rank: int) -> Trainer:
    cfg = to_train_config(compose_config(OVERRIDES))
    return Trainer(
        cfg,
        info=init_distributed(),
        run_dir=Path(run_dir) / f"rank{rank}",
        experiment="host_sync",
        policies=build_policies(cfg),
        callbacks=[],
    )


class _Watch:
    """Counts host reads inside each step, and keeps the state after each step."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.reads: dict[int, Counter] = {}
        self.states: dict[int, dict[str, torch.Tensor]] = {}
        step_fn = trainer._train_step

        def counted_step(step: int) -> Any:
            with host_reads() as seen:
                out = step_fn(step)
            self.reads[step + 1] = seen
            return out

        trainer._train_step = counted_step  # type: ignore[method-assign]

    def on_train_batch_end(self, trainer: Trainer, step: int) -> None:
        self.states[step] = snapshot(trainer)


def snapshot(trainer: Trainer) -> dict[str, torch.Tensor]:
    """This rank's parameters and optimizer state, copied."""
    out = {f"param {i}": p.detach().clone() for i, p in enumerate(trainer.model.parameters())}
    for i, p in enumerate(trainer.model.parameters()):
        for name, value in trainer.optimizer.state.get(p, {}).items():
            out[f"state {i} {name}"] = value.detach().clone()
    return out


def _clean_run(rank: int, world_size: int, run_dir: str) -> dict:
    trainer = _trainer(run_dir, rank)
    watch = _Watch(trainer)
    trainer.callbacks.append(watch)
    read_fn = trainer._read
    interval_reads = []

    def counted_read(*args: Any) -> Any:
        with host_reads() as seen:
            out = read_fn(*args)
        interval_reads.append(dict(seen))
        return out

    trainer._read = counted_read  # type: ignore[method-assign]
    trainer.fit()
    return {
        "reads": {step: dict(c) for step, c in watch.reads.items()},
        "interval_reads": interval_reads,
        "steps": [m.step for m in trainer.metrics],
        "finite": all(math.isfinite(m.loss) and math.isfinite(m.grad_norm) for m in trainer.metrics),
        "moved": not all(torch.equal(watch.states[1][k], watch.states[STEPS][k]) for k in watch.states[1]),
    }


def _diverge(rank: int, world_size: int, run_dir: str, what: str) -> dict:
    """Make step 2 non-finite (its loss, or only a gradient) in the middle of the read interval."""
    trainer = _trainer(run_dir, rank)
    watch = _Watch(trainer)
    trainer.callbacks.append(watch)
    loss_fn = trainer._loss

    if what == "loss":

        def nan_at_step_2(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = loss_fn(x, y)
            return loss * float("nan") if len(watch.states) == 1 else loss

        trainer._loss = nan_at_step_2  # type: ignore[method-assign]
    else:

        class PoisonGradient:
            def on_after_backward(self, trainer: Trainer, step: int) -> None:
                if step == 2:
                    next(p for p in trainer.model.parameters() if p.grad is not None).grad.view(-1)[0] = float("inf")

        trainer.callbacks.append(PoisonGradient())
    with pytest.raises(TrainingDiverged) as error:
        trainer.fit()
    after = snapshot(trainer)
    return {
        "message": str(error.value),
        "step": error.value.step,
        "steps_run": sorted(watch.states),
        "unchanged": all(torch.equal(after[k], watch.states[1][k]) for k in watch.states[1]),
        "keys": len(watch.states[1]),
        "scheduler_epoch": trainer.scheduler.last_epoch,
        "lr": trainer.optimizer.param_groups[0]["lr"],
        "reads": {step: dict(c) for step, c in watch.reads.items()},
        "metrics": [m.step for m in trainer.metrics],
    }


def test_a_step_reads_nothing_on_the_host_and_an_interval_once() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        results = run_distributed(_clean_run, 2, args=(tmp,), timeout=100)
    for res in results:
        assert res["reads"] == {step: {} for step in range(1, STEPS + 1)}, res["reads"]
        # The interval's read is one transfer of every step's loss and norm (the counter sees reads).
        assert res["interval_reads"] == [{"tolist": 1}], res["interval_reads"]
        assert res["steps"] == list(range(1, STEPS + 1)), "metrics.csv still gets one row per step"
        assert res["finite"], "a healthy run has finite losses and norms"
        assert res["moved"], "a healthy run changes the weights"


@pytest.mark.parametrize("what", ["loss", "gradient"])
def test_a_non_finite_step_mid_interval_changes_nothing(what: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        results = run_distributed(_diverge, 2, args=(tmp, what), timeout=100)
    for res in results:
        bad = "training loss became nan" if what == "loss" else "gradient norm became inf"
        assert res["message"].startswith(f"{bad} at step 2; the update was skipped"), res["message"]
        assert res["step"] == 2
        assert res["steps_run"] == [1, 2, 3, 4], "the run stops at the interval's read, not before"
        # Steps 2-4 reached neither the weights nor the optimizer's moments and step counts.
        assert res["keys"] > 0
        assert res["unchanged"]
        assert res["scheduler_epoch"] == 1, "the LR schedule is put back to after step 1"
        assert res["metrics"] == [1], "the good step before the bad one is recorded"
        assert all(reads == {} for reads in res["reads"].values()), res["reads"]
