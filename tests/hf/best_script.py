"""Launched by tests/hf/test_load_best.py (plain python, W=1): ``load_best_model_at_end`` on ShardlineTrainer.

``python best_script.py OUT``: a tiny Llama trained 6 steps, evaluated and saved every 2, with
``metric_for_best_model="loss"`` and ``greater_is_better=True`` -- the eval loss falls as it trains,
so the best checkpoint is an early one, not the last -- and ``save_total_limit=1``. A callback keeps
the gathered weights at each save; ``OUT/best.json`` says which checkpoint Trainer chose and whether
the model at the end holds its weights (and not the last ones).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import TrainerCallback

import shardline
from shardline.hf import ShardlineTrainer
from tests.hf.trainer_script import Tokens, llama, targs


class Snapshots(TrainerCallback):
    """The gathered weights at each save (``on_save`` runs right after the checkpoint is written)."""

    def __init__(self) -> None:
        self.saved: dict[int, dict[str, torch.Tensor]] = {}

    def on_save(self, args, state, control, model=None, **kwargs):
        self.saved[state.global_step] = {k: v.detach().clone() for k, v in shardline.full_state_dict(model).items()}


def main(out: Path) -> None:
    snapshots = Snapshots()
    args = targs(
        out, "best", max_steps=6, learning_rate=1e-2, eval_strategy="steps", eval_steps=2, save_strategy="steps",
        save_steps=2, load_best_model_at_end=True, metric_for_best_model="loss", greater_is_better=True,
        save_total_limit=1,
    )  # fmt: skip
    trainer = ShardlineTrainer(
        model=llama(), args=args, train_dataset=Tokens(), eval_dataset=Tokens(), callbacks=[snapshots]
    )
    trainer.train()
    final = shardline.full_state_dict(trainer.model)
    best = trainer.state.best_model_checkpoint
    best_step = int(Path(best).name.split("-")[1]) if best else None
    last = max(snapshots.saved)

    def same(step: int) -> bool:
        return all(torch.equal(final[k], snapshots.saved[step][k]) for k in final)

    result = {
        "best_model_checkpoint": best,
        "best_step": best_step,
        "saved": sorted(snapshots.saved),
        "eval_loss": {str(r["step"]): r["eval_loss"] for r in trainer.state.log_history if "eval_loss" in r},
        "equals_best": same(best_step) if best_step is not None else False,
        "equals_last": same(last),
        "kept": sorted(p.name for p in (out / "best").glob("checkpoint-*")),
    }
    (out / "best.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    if dist.is_initialized():
        dist.destroy_process_group()
