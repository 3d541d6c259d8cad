"""Launched by tests/hf/test_fp16.py (torchrun W=2, or plain python W=1): ``ShardlineTrainer(fp16=True)`` runs.

``python fp16_script.py PHASE OUT``. Every run trains the tiny Llama of ``trainer_script.py`` for
four steps with ``fp16=True`` and ``LossScaling(init_scale=2**10, growth_interval=2)``; at step 1
an inf is written into one gradient element of the *last* rank's shard only (after backward,
before the scaler's check). Each rank leaves ``NAME.rankR.json``: per step, whether the
optimizer step was skipped, whether this rank's shards changed, and the scale after the step.

* ``torchrun`` (W=2): ``fp16`` (saves checkpoint-2 and checkpoint-4); ``fp16_resumed`` (from
  ``fp16/checkpoint-2`` to step 4); ``fp16_torch``, the control: the same run with Accelerate's
  ``torch.amp.GradScaler`` put back in the accelerator (its inf check is per rank).
* ``single`` (W=1): ``fp16_single``, the same global batch in one process (the reference), and
  ``fp16_single_stepped`` without the inf (step 1 is taken: what parity must tell apart);
  ``fp32_old`` saves a checkpoint without loss-scaler state and ``fp16_from_old`` resumes it
  with fp16 (what it logged goes into ``fp16_from_old.log.txt``).
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import TrainerCallback

import shardline
from shardline.hf import ShardlineTrainer
from tests.hf.trainer_script import Tokens, llama, record, targs

OVERFLOW_AT = 1
POLICY = shardline.LossScaling(init_scale=2.0**10, growth_interval=2)


class Overflowing(ShardlineTrainer):
    """Writes an inf into the last rank's gradient shard after the backward of step ``OVERFLOW_AT``."""

    inject = True

    def training_step(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        loss = super().training_step(model, inputs, *args, **kwargs)
        last = dist.get_rank() == dist.get_world_size() - 1
        if self.inject and self.state.global_step + 1 == OVERFLOW_AT and last:
            grad = next(p.grad for p in model.parameters() if p.grad is not None and p.grad.numel())
            grad.view(-1)[0] = float("inf")
        return loss


class Steps(TrainerCallback):
    """Per optimizer step, on this rank: skipped, this rank's shards changed, the scale after it."""

    def __init__(self) -> None:
        self.trainer: Any = None
        self.rows: list[dict[str, Any]] = []

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self._before = [p.detach().clone() for p in model.parameters()]

    def on_step_end(self, args, state, control, model=None, **kwargs):
        changed = not all(torch.equal(a, p.detach()) for a, p in zip(self._before, model.parameters(), strict=True))
        scaler = self.trainer.accelerator.scaler
        self.rows.append(
            {
                "step": state.global_step,
                "skipped": bool(self.trainer.accelerator.optimizer_step_was_skipped),
                "changed": changed,
                "scale": float(scaler.get_scale()),
                "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
            }
        )


def run(
    out: Path, name: str, *, torch_scaler: bool = False, resume: str | None = None, inject: bool = True, **kw: Any
) -> None:
    steps = Steps()
    # SGD (momentum 0.9): two runs' weights differ by the learning rate times their gradients' difference.
    kw = {
        "optim": "sgd",
        "optim_args": "momentum=0.9",
        "learning_rate": 0.2,
        "save_strategy": "steps",
        "save_steps": 2,
        **kw,
    }
    args = targs(out, name, fp16=True, **kw)
    trainer = Overflowing(model=llama(), args=args, train_dataset=Tokens(), callbacks=[steps], loss_scaling=POLICY)
    trainer.inject = inject
    steps.trainer = trainer
    if torch_scaler:  # the control: Accelerate's own scaler class (its inf check sees this rank's gradients only)
        trainer.accelerator.scaler = torch.amp.GradScaler(
            "cpu", init_scale=POLICY.init_scale, growth_interval=POLICY.growth_interval
        )
        trainer._shardline_scaler = None
    trainer.train(resume_from_checkpoint=resume)
    scaler = trainer.accelerator.scaler
    said = {
        "steps": steps.rows,
        "scaler_type": type(scaler).__name__,
        "final_state": scaler.state_dict() if not torch_scaler else None,
    }
    (out / f"{name}.rank{dist.get_rank()}.json").write_text(json.dumps(said))
    record(out, name, trainer, shardline.full_state_dict(trainer.model), evaluate=False)


def torchrun_phase(out: Path) -> None:
    run(out, "fp16")
    run(out, "fp16_resumed", resume=str(out / "fp16" / "checkpoint-2"))
    run(out, "fp16_torch", torch_scaler=True)


def single_phase(out: Path) -> None:
    # The W=2 runs' global batch (2 ranks x 2 samples) in one process.
    run(out, "fp16_single", per_device_train_batch_size=4)
    run(out, "fp16_single_stepped", per_device_train_batch_size=4, inject=False)  # step 1 taken: parity must fail
    # A checkpoint saved without loss-scaler state (a 32-bit run), resumed by an fp16 run.
    old = ShardlineTrainer(
        model=llama(), args=targs(out, "fp32_old", max_steps=2, save_strategy="steps", save_steps=2),
        train_dataset=Tokens(),
    )  # fmt: skip
    old.train()
    lines: list[str] = []

    class Lines(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger = logging.getLogger("shardline.hf")
    logger.addHandler(Lines(level=logging.INFO))
    logger.setLevel(logging.INFO)
    resumed = ShardlineTrainer(
        model=llama(), args=targs(out, "fp32_old", max_steps=3, fp16=True), train_dataset=Tokens(),
        loss_scaling=POLICY,
    )  # fmt: skip
    resumed.train(resume_from_checkpoint=str(out / "fp32_old" / "checkpoint-2"))
    (out / "fp16_from_old.log.txt").write_text(
        json.dumps({"lines": lines, "step": resumed.state.global_step, "scale": resumed.accelerator.scaler.get_scale()})
    )


if __name__ == "__main__":
    phase, out = sys.argv[1], Path(sys.argv[2])
    {"torchrun": torchrun_phase, "single": single_phase}[phase](out)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    print(f"phase {phase} done", flush=True)
