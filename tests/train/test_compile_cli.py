"""``shardline train trainer.compile=true``: each wrapped block compiled, the same losses as eager."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.numerics import assert_trajectories
from tests.train.test_cli import SMALL, only_run_dir, read_metrics, shardline_train

# Compiling the block's forward and backward takes 20-40 s on 2 busy CPU cores.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
TINY = ["model.dim=32", "model.n_layers=2", "trainer.max_steps=4"]


def _losses(run_root: Path, *overrides: str) -> tuple[list[float], list[float], str]:
    """Training and validation losses of a run, and rank 0's log."""
    proc = shardline_train(*SMALL, *TINY, *overrides, run_root=run_root, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = only_run_dir(run_root)
    rows = read_metrics(run_dir)
    train = [float(r["loss"]) for r in rows if r["loss"]]
    val = [float(r["val_loss"]) for r in rows if r["val_loss"]]
    return train, val, (run_dir / "logs" / "rank0.log").read_text()


def test_compiled_training_equals_eager(tmp_path: Path) -> None:
    eager, eager_val, eager_log = _losses(tmp_path / "eager")
    compiled, compiled_val, log = _losses(tmp_path / "compiled", "trainer.compile=true")
    assert "torch.compile" not in eager_log
    assert "torch.compile on 2 modules" in log, log  # the two blocks, not the root
    assert len(compiled) == 4
    assert_trajectories(compiled, eager, "trainer.compile=true vs eager")
    assert_trajectories(compiled_val, eager_val, "trainer.compile=true vs eager, validation")
