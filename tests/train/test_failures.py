"""Fault injection at the launcher: bad input refused before any worker starts, one run per directory,
records never replaced, and failures whose first line names the cause."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import shardline.checkpoint as ckpt
from shardline.errors import RunLockedError
from shardline.train.build import build_model
from shardline.train.config import compose_config, to_train_config
from shardline.train.launcher import train
from shardline.train.runlock import LOCK_NAME, RunLock
from tests.train.test_cli import GPT_SMALL, PYTHONPATH, SMALL, error_line, read_metrics, shardline_train

QUICK = [*SMALL, *GPT_SMALL, "~callbacks.tensorboard", "~callbacks.loss_plot", "~callbacks.diagnostics"]


def _refused(capsys, tmp_path: Path, *overrides: str) -> str:
    """Run ``shardline train`` in this process; it must exit 2 with one line and start nothing."""
    root = tmp_path / "runs"
    code = train([f"trainer.run_root={root}", *QUICK, *overrides])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1, f"one line, got:\n{err}"
    assert err.startswith("error: "), err
    assert not list(root.glob("*/*")), "no run directory: no worker started"
    return err


def _checkpoint_of_another_shape(path: Path) -> None:
    cfg = to_train_config(compose_config([*GPT_SMALL, "model.dim=32"]))
    ckpt.save(path, model=build_model(cfg, device="cpu"), step=1)


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("lr_nan", "optimizer.lr=nan is not a finite number"),
        ("no_data_root", "/no-such-dir: no such directory"),
        ("tiny_data", "data.max_bytes must be at least 1024, got 10"),
        ("resume_not_a_checkpoint", "is not a checkpoint"),
        ("resume_other_shape", "blocks.0.attn.proj.weight: checkpoint shape (32, 32) vs model (64, 64)"),
        ("run_dir_is_a_file", "is a file, not a directory"),
    ],
)
def test_bad_input_is_refused_before_workers_start(capsys, tmp_path: Path, case: str, expected: str) -> None:
    overrides = {
        "lr_nan": ["optimizer.lr=nan"],
        "no_data_root": [f"data.root={tmp_path / 'no-such-dir'}"],
        "tiny_data": ["data.max_bytes=10"],
        "resume_not_a_checkpoint": [f"trainer.resume={tmp_path}"],
        "resume_other_shape": [f"trainer.resume={tmp_path / 'step-1'}"],
        "run_dir_is_a_file": [f"trainer.run_dir={tmp_path / 'a-file'}"],
    }[case]
    (tmp_path / "a-file").write_text("not a directory")
    if case == "resume_other_shape":
        _checkpoint_of_another_shape(tmp_path / "step-1")
    assert expected in _refused(capsys, tmp_path, *overrides)


def _digests(run_dir: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in run_dir.iterdir() if p.is_file()}


def test_a_second_run_on_a_directory_is_refused_naming_the_holder(capsys, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with RunLock(run_dir):
        err = _refused(capsys, tmp_path, f"trainer.run_dir={run_dir}", "trainer.resume=auto")
    assert f"is in use by another run (pid {os.getpid()} on " in err
    assert not (run_dir / LOCK_NAME).exists(), "the lock file goes with its holder"


def test_a_stale_lock_is_reported_and_taken_over(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    record = {"pid": dead.pid, "host": os.uname().nodename, "started": "2020-01-01T00:00:00Z", "command": "x"}
    (tmp_path / LOCK_NAME).write_text(json.dumps(record) + "\n")
    with RunLock(tmp_path) as lock:
        assert lock.stale is not None
        assert lock.stale.pid == dead.pid
        assert lock.stale.is_alive_here() is False
        with pytest.raises(RunLockedError, match=f"pid {os.getpid()} on"):
            RunLock(tmp_path).acquire()  # held now: a second holder is refused


def test_resume_auto_never_restarts_over_a_finished_run(capsys, tmp_path: Path) -> None:
    run_dir = tmp_path / "finished"
    run_dir.mkdir()
    rows = "step,loss\n" + "".join(f"{i},1.0\n" for i in range(41))
    (run_dir / "metrics.csv").write_text(rows)
    (run_dir / "summary.json").write_text('{"steps": 40}\n')
    (run_dir / "loss.png").write_bytes(b"\x89PNG")
    (run_dir / "config.yaml").write_text("x: 1\n")
    before = _digests(run_dir)
    err = _refused(capsys, tmp_path, f"trainer.run_dir={run_dir}", "trainer.resume=auto")
    assert "holds an earlier run's records (metrics.csv, summary.json) but no committed checkpoint" in err
    assert _digests(run_dir) == before, "nothing the run wrote is replaced"


def test_a_stopped_worker_ends_the_job_naming_it(tmp_path: Path) -> None:
    stamp = tmp_path / "stopped"
    proc = shardline_train(
        *QUICK,
        "trainer.collective_timeout_s=8",
        "+callbacks.stop._target_=tests.train.helpers.StopOnRank",
        f"+callbacks.stop.record={stamp}",
        run_root=tmp_path,
    )
    ended = time.time()
    pid, stopped_at = stamp.read_text().split()
    assert proc.returncode == 1, proc.stderr
    first = error_line(proc.stderr)
    assert "trainer.collective_timeout_s=8" in first, first
    assert "stalled rank 1 (no heartbeat for" in first, first
    assert ended - float(stopped_at) < 8 + 15, f"ended {ended - float(stopped_at):.0f} s after the stop"
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid), 0)  # the stopped worker did not outlive the job


def test_disk_full_during_an_async_save_names_path_sizes_and_last_good(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = shardline_train(
        *QUICK,
        "checkpoint.every_n_steps=2",
        "checkpoint.async_save=true",
        "+callbacks.full._target_=tests.train.helpers.DiskFullAt",
        f"trainer.run_dir={run_dir}",
        run_root=tmp_path,
    )
    assert proc.returncode == 1, proc.stderr
    first = error_line(proc.stderr)
    checkpoints = run_dir / "checkpoints"
    assert f"DiskFullError: disk full: writing checkpoint {checkpoints / 'step-4'} needs about " in first, first
    assert " free on " in first
    assert f"the last good checkpoint is {checkpoints / 'step-2'}" in first, first
    assert sorted(p.name for p in checkpoints.iterdir() if p.name.startswith(("step-", "."))) == ["step-2"]
    assert ckpt.verify_checkpoint(checkpoints / "step-2").ok


def test_an_exception_in_training_completes_the_queued_async_save(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = shardline_train(
        *QUICK,
        "checkpoint.every_n_steps=2",
        "checkpoint.async_save=true",
        "+callbacks.slow._target_=tests.train.helpers.SlowCheckpointFiles",
        "+callbacks.fail._target_=tests.train.helpers.RaiseEverywhere",
        f"trainer.run_dir={run_dir}",
        run_root=tmp_path,
    )
    assert proc.returncode == 1, proc.stderr
    assert "injected failure on every rank at step 3" in proc.stderr
    checkpoints = run_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir() if p.name.startswith(("step-", "."))) == ["step-2"]
    assert ckpt.verify_checkpoint(checkpoints / "step-2").ok
    assert [r.step for r in ckpt.Ledger(run_dir / "lineage.sqlite").rows()] == [2]


def test_the_launcher_survives_an_empty_error_file(tmp_path: Path) -> None:
    proc = shardline_train(
        *QUICK, "+callbacks.quit._target_=tests.train.helpers.EmptyErrorFileThenExit", run_root=tmp_path
    )
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    first = error_line(proc.stderr)
    # Which of the two the launcher can say depends on whether rank 0's report of the lost peer arrived in time.
    assert first.startswith(("error: worker rank 1 ended without reporting an error", "error: a worker failed")), first
    assert len(read_metrics(next(tmp_path.glob("*/*")))) >= 1


def test_resume_auto_over_a_damaged_checkpoint_falls_back_in_one_line(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    common = [*QUICK, "checkpoint.every_n_steps=2", f"trainer.run_dir={run_dir}"]
    first = shardline_train(*common, "trainer.max_steps=4", run_root=tmp_path)
    assert first.returncode == 0, first.stderr
    shard = run_dir / "checkpoints" / "step-4" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    resumed = shardline_train(*common, "trainer.resume=auto", run_root=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    said = [line for line in resumed.stderr.splitlines() if "moved aside" in line]
    assert len(said) == 1, resumed.stderr
    assert "step-4 failed verification" in said[0]
    assert "__0_0.distcp: altered" in said[0]
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert names[:2] == ["step-2", "step-4"]
    assert names[2].startswith("step-4.damaged-")
    assert names[3:] == ["step-6"]
    assert "resumed from step 2" in (run_dir / "logs" / "rank0.log").read_text()
    lineage = subprocess.run(
        [sys.executable, "-m", "shardline.cli", "lineage", str(run_dir)],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": PYTHONPATH}, timeout=60,
    )  # fmt: skip
    assert lineage.returncode == 0, lineage.stdout + lineage.stderr
    assert "quarantine: checkpoints/step-4 failed verification" in lineage.stdout
