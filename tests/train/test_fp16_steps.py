"""``trainer.precision=16-mixed`` over checkpoints and in the records: the loss scaler's state is saved and
restored, and a step the scaler skipped is recorded as skipped (no NaN norm, valid JSON).

One two-rank launch: a run whose step 1 overflows on the last rank's gradient shard only (an inf
written after backward), saving at step 2; a run resumed from that checkpoint to the same end;
and a 32-bit checkpoint (no scaler state) resumed under ``16-mixed``.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
import math
from pathlib import Path
from typing import Any

import torch

from shardline.distributed import init_distributed
from shardline.testing import run_distributed
from shardline.train.build import build_policies
from shardline.train.callbacks import MetricsCSV
from shardline.train.config import compose_config, to_train_config
from shardline.train.trainer import Trainer

OVERRIDES = [
    "trainer.max_steps=4",
    "trainer.log_every_n_steps=1",
    "trainer.val_check_interval=4",
    "trainer.val_batches=1",
    "trainer.micro_batch_size=2",
    "trainer.precision=16-mixed",
    "data.max_bytes=50000",
    "data.seq_len=16",
    "model.dim=32",
    "model.n_layers=2",
    "checkpoint.every_n_steps=2",
    "checkpoint.save_on_exception=false",
]
INIT_SCALE = 2.0**16  # LossScaling's default


class Overflow:
    """An inf in one gradient element of the last rank's shard, after the backward of step 1."""

    def on_after_backward(self, trainer: Trainer, step: int) -> None:
        if step == 1 and trainer.info.rank == trainer.info.world_size - 1:
            grad = next(p.grad for p in trainer.model.parameters() if p.grad is not None and p.grad.numel())
            grad.view(-1)[0] = float("inf")


def _trainer(run_dir: Path, extra: list[str], callbacks: list[object]) -> Trainer:
    cfg = to_train_config(compose_config(OVERRIDES + extra))
    return Trainer(
        cfg,
        info=init_distributed(),
        run_dir=run_dir,
        experiment="fp16",
        policies=build_policies(cfg),
        callbacks=callbacks,
    )


def _run(rank: int, world_size: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    full = _trainer(Path(root) / "full", [], [Overflow(), MetricsCSV()])
    full.fit()
    out["metrics"] = [dataclasses.asdict(m) for m in full.metrics]
    out["scaler"] = full.scaler.state_dict() if full.scaler is not None else None
    step2 = Path(root) / "full" / "checkpoints" / "step-2"
    resumed = _trainer(Path(root) / "resumed", [f"trainer.resume={step2}"], [])
    resumed.fit()
    out["resumed_scaler"] = resumed.scaler.state_dict() if resumed.scaler is not None else None
    out["bit_identical"] = all(
        torch.equal(a, b) for a, b in zip(full.model.parameters(), resumed.model.parameters(), strict=True)
    )
    # A checkpoint without loss-scaler state (a 32-bit run's), resumed under 16-mixed.
    old = _trainer(Path(root) / "old", ["trainer.precision=32-true", "trainer.max_steps=2"], [])
    old.fit()
    lines: list[str] = []

    class Lines(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger = logging.getLogger("shardline.train")
    logger.addHandler(Lines(level=logging.INFO))
    logger.setLevel(logging.INFO)
    step2 = Path(root) / "old" / "checkpoints" / "step-2"
    later = _trainer(Path(root) / "later", [f"trainer.resume={step2}", "trainer.max_steps=3"], [])
    out["old_lines"] = lines
    out["old_scale"] = later.scaler.get_scale() if later.scaler is not None else None
    return out


def test_fp16_scale_survives_resume_and_a_skipped_step_is_recorded(tmp_path: Path) -> None:
    results = run_distributed(_run, 2, args=(str(tmp_path),), timeout=110)
    res = results[0]
    # Step 1 overflowed on rank 1 only: recorded on rank 0 as skipped, the loss measured, no norm.
    first, *rest = res["metrics"]
    assert (first["step"], first["skipped"], first["grad_norm"]) == (1, True, None), first
    assert math.isfinite(first["loss"])
    assert all(not m["skipped"] and math.isfinite(m["grad_norm"]) for m in rest), rest
    json.dumps(res["metrics"], allow_nan=False)  # strict JSON: no NaN anywhere
    with open(tmp_path / "full" / "metrics.csv", newline="") as f:
        rows = {r["step"]: r for r in csv.DictReader(f)}
    assert (rows["1"]["skipped"], rows["1"]["grad_norm"]) == ("True", "")
    assert rows["2"]["skipped"] == "False"
    assert float(rows["2"]["grad_norm"]) > 0
    # The scale backed off once (step 1), then counted three clean steps; the same on both ranks.
    expected = {"scale": INIT_SCALE / 2, "growth_tracker": 3}
    assert [r["scaler"] for r in results] == [expected, expected]
    # Resumed from step 2 (scale halved, one clean step counted): bit-identical weights, the same scaler state.
    assert [r["bit_identical"] for r in results] == [True, True]
    assert [r["resumed_scaler"] for r in results] == [expected, expected]
    # A checkpoint without scaler state: loads, the scale starts fresh, and the log says so (rank 0).
    assert res["old_scale"] == INIT_SCALE
    said = [line for line in res["old_lines"] if "loss-scaler" in line]
    assert said == [
        "the checkpoint of step 2 holds no loss-scaler state (saved before 16-mixed runs recorded it, or by a run in "
        f"another precision): the loss scale starts fresh at {INIT_SCALE}"
    ], res["old_lines"]
