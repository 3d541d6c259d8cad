"""A run resumed at another world size keeps its global batch and trains on exactly the samples an
uninterrupted run does: the same ``data_digest`` at every step, the same losses up to reduction order."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.numerics import Reorder, assert_reordered, assert_trajectories, max_rel_err
from tests.train.test_cli import GPT_SMALL, SMALL, error_line, read_metrics, shardline_train

pytestmark = pytest.mark.numerics

COMMON = [*SMALL, *GPT_SMALL, "checkpoint.every_n_steps=2", "~callbacks.tensorboard", "~callbacks.loss_plot"]
MICRO, ACCUMULATE, WORLD = 4, 2, 2  # SMALL's micro-batch, the default accumulation, the default devices
GLOBAL = MICRO * ACCUMULATE * WORLD


def newest_rows(run_dir: Path) -> dict[int, dict[str, str]]:
    """Each step's newest row (a resumed attempt recomputes the steps after its checkpoint)."""
    return {int(r["step"]): r for r in read_metrics(run_dir) if r["loss"]}


def test_a_two_rank_run_resumed_on_one_rank_continues_the_same_samples(tmp_path: Path) -> None:
    straight = shardline_train(*COMMON, f"trainer.run_dir={tmp_path / 'a'}", run_root=tmp_path)
    assert straight.returncode == 0, straight.stderr
    crashed = shardline_train(
        *COMMON,
        f"trainer.run_dir={tmp_path / 'b'}",
        "+callbacks.crash._target_=tests.train.helpers.CrashOnRank",
        "+callbacks.crash.step=3",
        run_root=tmp_path,
    )
    assert crashed.returncode == 1
    assert sorted(p.name for p in (tmp_path / "b" / "checkpoints").glob("step-*")) == ["step-2"]

    # One rank cannot cut the recorded global batch of 16 into micro-batches of 3: refused before any worker.
    refused = shardline_train(
        *COMMON, "trainer.devices=1", "trainer.micro_batch_size=3", "trainer.resume=auto",
        f"trainer.run_dir={tmp_path / 'b'}", run_root=tmp_path,
    )  # fmt: skip
    assert refused.returncode == 2, refused.stderr
    line = error_line(refused.stderr)
    assert "global batch (recorded in its checkpoint) is 16 sequences" in line, line
    assert "micro-batches of 3 (trainer.micro_batch_size) on 1 ranks" in line, line

    resumed = shardline_train(
        *COMMON, "trainer.devices=1", "trainer.resume=auto", f"trainer.run_dir={tmp_path / 'b'}", run_root=tmp_path
    )
    assert resumed.returncode == 0, resumed.stderr
    log = (tmp_path / "b" / "logs" / "rank0.log").read_text()
    assert "resumed from step 2" in log
    assert f"global batch {GLOBAL} at world size 1: {GLOBAL // MICRO} accumulation steps" in log

    a, b = newest_rows(tmp_path / "a"), newest_rows(tmp_path / "b")
    assert sorted(a) == sorted(b) == list(range(1, 7))
    assert [b[s]["world_size"] for s in range(1, 7)] == ["2", "2", "1", "1", "1", "1"]
    assert all(len(a[s]["data_digest"]) == 16 for s in a)
    assert [b[s]["data_digest"] for s in range(1, 7)] == [a[s]["data_digest"] for s in range(1, 7)], (
        "every step trains on the same global batch whatever the world size"
    )
    assert len({a[s]["data_digest"] for s in a}) == 6
    assert [b[s]["loss"] for s in (1, 2)] == [a[s]["loss"] for s in (1, 2)], "the first attempt's rows are kept"

    # Step 3, the first after the restart, starts from the very weights step 2 saved, and each
    # micro-batch (same samples, same size: ranks take contiguous slices) computes its mean loss
    # with the same kernels. Only the combination of the GLOBAL / MICRO micro-batch means changes
    # order (two per rank, then the mean over ranks, vs four in one sum), plus the division.
    first = float(b[3]["loss"]), float(a[3]["loss"])
    rule = Reorder(terms=GLOBAL // MICRO + 1)
    assert_reordered(max_rel_err(*map(_tensor, first)), rule, "loss of the first step after the restart")
    # Later steps follow Adam's trajectory from gradients reduced in another order: assert_close's
    # fp32 defaults (rtol 1.3e-6, atol 1e-5), which for these losses (> 1) is within 1e-5 relative.
    later = [float(b[s]["loss"]) for s in range(3, 7)], [float(a[s]["loss"]) for s in range(3, 7)]
    assert_trajectories(*later, "steps after the restart at world size 1")
    assert all(abs(x - y) <= 1e-5 * abs(y) for x, y in zip(*later, strict=True)), later
    vals = [(float(b[s]["val_loss"]), float(a[s]["val_loss"])) for s in (3, 6)]
    assert_trajectories(*zip(*vals, strict=True), "validation after the restart")


def _tensor(value: float):
    import torch

    return torch.tensor(value, dtype=torch.float64)
