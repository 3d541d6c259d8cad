"""Restarts that lose nothing: a preempted run saves the step in flight and resumes bit-identically at
the same world size; resumed at another world size it keeps its global batch and trains on exactly the
samples an uninterrupted run does (the same ``data_digest`` at every step, the same losses up to
reduction order).

One uninterrupted two-rank run (:func:`straight`, shared by the session) is the reference of these
tests and of the elastic torchrun scenario (``test_elastic_torchrun.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardline.checkpoint.provenance.statement import read_statement
from tests.numerics import Reorder, assert_reordered, assert_trajectories, max_rel_err
from tests.train.test_cli import GPT_SMALL, PYTHONPATH, SMALL, error_line, read_metrics, shardline_train

pytestmark = pytest.mark.numerics

STEPS = 12
COMMON = [
    *SMALL,
    *GPT_SMALL,
    f"trainer.max_steps={STEPS}",
    "checkpoint.every_n_steps=2",
    "~callbacks.tensorboard",
    "~callbacks.loss_plot",
]
MICRO, ACCUMULATE, WORLD = 4, 2, 2  # SMALL's micro-batch, the default accumulation, the default devices
GLOBAL = MICRO * ACCUMULATE * WORLD
PREEMPTED_AT = 3


def newest_rows(run_dir: Path) -> dict[int, dict[str, str]]:
    """Each step's newest row (a resumed attempt recomputes the steps after its checkpoint)."""
    return {int(r["step"]): r for r in read_metrics(run_dir) if r["loss"]}


@pytest.fixture(scope="session")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted two-rank run of COMMON."""
    root = tmp_path_factory.mktemp("straight")
    proc = shardline_train(*COMMON, f"trainer.run_dir={root / 'a'}", run_root=root)
    assert proc.returncode == 0, proc.stderr
    return root / "a"


def cli(*args: str) -> str:
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    proc = subprocess.run(
        [sys.executable, "-m", "shardline.cli", *args], capture_output=True, text=True, env=env, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def restart_rows(run_dir: Path) -> list[dict]:
    return [r for r in json.loads(cli("lineage", str(run_dir), "--json"))["rows"] if r["event"] == "restart"]


def _curve(run_dir: Path) -> list[tuple[str, ...]]:
    rows = newest_rows(run_dir)
    keys = ("loss", "val_loss", "lr", "grad_norm", "world_size", "data_digest")
    return [(str(step), *(rows[step][k] for k in keys)) for step in sorted(rows)]


# Each launch has its own deadline (110 s, tests.train.test_cli): a hang fails there. The test's
# own limit covers its four launches on a loaded 2-core machine.
@pytest.mark.timeout(360)
def test_a_preempted_run_resumes_bit_identically_and_on_one_rank_with_the_same_samples(
    tmp_path: Path, straight: Path
) -> None:
    run = tmp_path / "p"
    preempted = shardline_train(
        *COMMON,
        f"trainer.run_dir={run}",
        "+callbacks.term._target_=tests.train.helpers.SigtermAt",
        "+callbacks.term.rank=1",  # rank 0 never sees the signal: the ranks agree at the step's end
        f"+callbacks.term.step={PREEMPTED_AT}",
        run_root=tmp_path,
    )
    assert preempted.returncode == 143, preempted.stdout + preempted.stderr
    assert "preempted (SIGTERM) after step 3; saved step-3-preempted; continue with trainer.resume=auto" in (
        preempted.stderr
    )
    assert "Traceback" not in preempted.stderr, preempted.stderr
    assert "error:" not in preempted.stderr, preempted.stderr
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == ["step-2", "step-3-preempted"]
    assert max(int(r["step"]) for r in read_metrics(run)) == PREEMPTED_AT, "the step in flight was finished"
    assert not (run / ".shardline.lock").exists(), "the run directory's lock was released"
    saved = run / "checkpoints" / "step-3-preempted"

    # Same world size: trainer.resume=auto continues from the preemption save, bit for bit.
    resumed = shardline_train(*COMMON, f"trainer.run_dir={run}", "trainer.resume=auto", run_root=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from step 3" in (run / "logs" / "rank0.log").read_text()
    assert _curve(run) == _curve(straight), "a preemption at the same world size loses nothing and changes nothing"
    (restart,) = restart_rows(run)
    assert json.loads(restart["detail"]) == {
        "checkpoint": "checkpoints/step-3-preempted",
        "world_size_before": 2,
        "world_size_after": 2,
        "cause": "preempted",
    }

    # One rank (and no sharding) cannot cut the recorded global batch of 16 into micro-batches of 3:
    # refused before any worker starts.
    one_rank = ["trainer.strategy=single_device", "trainer.devices=1", f"trainer.resume={saved}"]
    refused = shardline_train(
        *COMMON, *one_rank, "trainer.micro_batch_size=3", f"trainer.run_dir={tmp_path / 'w1'}", run_root=tmp_path
    )
    assert refused.returncode == 2, refused.stderr
    line = error_line(refused.stderr)
    assert "global batch (recorded in its checkpoint) is 16 sequences" in line, line
    assert "micro-batches of 3 (trainer.micro_batch_size) on 1 ranks" in line, line

    # Another world size and strategy: the same global batch, the same samples, from step 4 on.
    branch = tmp_path / "w1"
    moved = shardline_train(*COMMON, *one_rank, f"trainer.run_dir={branch}", run_root=tmp_path)
    assert moved.returncode == 0, moved.stderr
    log = (branch / "logs" / "rank0.log").read_text()
    assert "resumed from step 3" in log
    assert f"global batch {GLOBAL} at world size 1: {GLOBAL // MICRO} accumulation steps" in log
    a, b = newest_rows(straight), newest_rows(branch)
    after = list(range(PREEMPTED_AT + 1, STEPS + 1))
    assert sorted(b) == after
    assert {b[s]["world_size"] for s in after} == {"1"}
    assert {a[s]["world_size"] for s in a} == {"2"}
    assert all(len(a[s]["data_digest"]) == 16 for s in a)
    assert len({a[s]["data_digest"] for s in a}) == STEPS
    assert [b[s]["data_digest"] for s in after] == [a[s]["data_digest"] for s in after], (
        "every step trains on the same global batch whatever the world size"
    )
    # Step 4, the first after the restart, starts from the very weights step 3 saved, and each
    # micro-batch (same samples, same size: ranks take contiguous slices) computes its mean loss
    # with the same kernels. Only the combination of the GLOBAL / MICRO micro-batch means changes
    # order (two per rank, then the mean over ranks, vs four in one sum), plus the division.
    first = torch.tensor(float(b[4]["loss"]), dtype=torch.float64), torch.tensor(float(a[4]["loss"]))
    assert_reordered(
        max_rel_err(*first), Reorder(terms=GLOBAL // MICRO + 1), "loss of the first step after the restart"
    )
    # Later steps follow Adam's trajectory from gradients reduced in another order: assert_close's
    # fp32 defaults (rtol 1.3e-6, atol 1e-5), which for these losses (> 1) is within 1e-5 relative.
    later = [float(b[s]["loss"]) for s in after], [float(a[s]["loss"]) for s in after]
    assert_trajectories(*later, "steps after the restart at world size 1")
    assert all(abs(x - y) <= 1e-5 * abs(y) for x, y in zip(*later, strict=True)), later
    vals = [(float(b[s]["val_loss"]), float(a[s]["val_loss"])) for s in after if a[s]["val_loss"]]
    assert_trajectories(*zip(*vals, strict=True), "validation after the restart")

    # Recorded: the branch's ledger starts with the restart, shown by `shardline lineage` and
    # `shardline report`; its first checkpoint descends from the preemption save, and its
    # provenance names the new world size.
    (restart,) = restart_rows(branch)
    assert (restart["step"], restart["world_size"]) == (PREEMPTED_AT, 1)
    detail = json.loads(restart["detail"])
    assert (detail["world_size_before"], detail["world_size_after"], detail["cause"]) == (2, 1, "node_lost")
    assert Path(branch, detail["checkpoint"]).resolve() == saved.resolve()
    shown = cli("lineage", str(branch))
    assert "restart: world size 2 -> 1 (node_lost), resumed from ../p/checkpoints/step-3-preempted at step 3" in shown
    cli("report", str(branch), "--out", str(tmp_path / "report.html"))
    assert "world size 2 -&gt; 1 (node_lost)" in (tmp_path / "report.html").read_text()
    manifest = json.loads((branch / "checkpoints" / "step-4" / "manifest.json").read_text())
    assert manifest["parent_manifest_sha256"] == (saved / "manifest.sha256").read_text().split()[0]
    assert manifest["world_size"] == 1
    statement, _ = read_statement(branch / "checkpoints" / "step-4")
    assert statement["predicate"]["distributed"]["world_size"] == 1
