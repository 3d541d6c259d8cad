"""``checkpoint.keep_best_k`` in ``shardline train``: bad settings refused before training; a run records each
checkpoint's validation loss in its commit row and keeps the best one plus the newest."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import shardline.checkpoint as ckpt
from shardline.errors import ConfigurationError
from shardline.train.config import compose_config, to_train_config, validate
from tests.train.test_cli import GPT_SMALL, SMALL, only_run_dir, read_metrics, shardline_train


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["checkpoint.keep_best_k=-1", "checkpoint.monitor=val_loss"], "keep_best_k must be a non-negative integer"),
        (["checkpoint.keep_best_k=2"], "keep_best_k=2 needs checkpoint.monitor"),
        (["checkpoint.keep_best_k=2", "checkpoint.monitor=val_loss", "checkpoint.mode=lowest"], "mode must be"),
        (["checkpoint.keep_best_k=2", "checkpoint.monitor=val_accuracy"], "'val_accuracy' is never logged"),
    ],
)
def test_bad_best_k_settings_are_refused_before_training(overrides: list[str], match: str) -> None:
    cfg = to_train_config(compose_config(["experiment=tiny_gpt", *overrides]))
    with pytest.raises(ConfigurationError, match=match):
        validate(cfg, launched=True)


def test_a_run_keeps_the_best_validation_loss_and_the_newest(tmp_path: Path) -> None:
    small = [a for a in SMALL if not a.startswith("trainer.val_check_interval")]
    proc = shardline_train(
        "trainer.strategy=single_device",
        "trainer.devices=1",
        *small,
        *GPT_SMALL,
        "trainer.val_check_interval=2",
        "checkpoint.every_n_steps=2",
        "checkpoint.keep_best_k=1",
        "checkpoint.monitor=val_loss",
        run_root=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    run_dir = only_run_dir(tmp_path)
    val = {int(r["step"]): float(r["val_loss"]) for r in read_metrics(run_dir) if r.get("val_loss")}
    commits = [r for r in ckpt.Ledger(run_dir / "lineage.sqlite").rows() if r.is_commit]
    assert [r.step for r in commits] == [2, 4, 6]
    for row in commits:  # the value recorded is the one the run logged for that step
        assert float(json.loads(row.detail)["metrics"]["val_loss"]) == val[row.step]
    best = min((2, 4, 6), key=lambda s: (val[s], -s))
    kept = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*"))
    assert kept == sorted({f"step-{best}", "step-6"})
