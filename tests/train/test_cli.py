"""``shardline train`` end to end: real workers, real files, failures that surface fast."""

from __future__ import annotations

import csv
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# This checkout's sources first (not whichever copy the environment installed), and the tests package.
PYTHONPATH = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
SMALL = [
    "trainer.max_steps=6",
    "trainer.val_check_interval=3",
    "trainer.val_batches=2",
    "trainer.micro_batch_size=4",
    "data.max_bytes=300000",
    "data.seq_len=64",
]
GPT_SMALL = ["model.dim=64", "model.n_layers=2"]
# The checkout's sources first (an installed shardline elsewhere must not shadow them), then the
# repository root for the tests' own modules (callbacks and models named in configs).
PYTHONPATH = os.pathsep.join([str(ROOT / "src"), str(ROOT)])


def shardline_train(*args: str, run_root: Path, timeout: float = 110) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": PYTHONPATH, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "shardline.cli", "train", f"trainer.run_root={run_root}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


def error_line(stderr: str) -> str:
    """The first line of the command's error output that starts with ``error:``."""
    return next(line for line in stderr.splitlines() if line.startswith("error:"))


def only_run_dir(run_root: Path) -> Path:
    dirs = [p for p in run_root.glob("*/*") if p.is_dir()]
    assert len(dirs) == 1, dirs
    return dirs[0]


def read_metrics(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.compat
def test_default_experiment_trains_on_two_workers(tmp_path: Path) -> None:
    proc = shardline_train(*SMALL, *GPT_SMALL, run_root=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = only_run_dir(tmp_path)
    assert run_dir.parent.name == "tiny_gpt"
    for name in ("config.yaml", "metrics.csv", "summary.json", "loss.png", "logs/rank0.log", "logs/rank1.log"):
        assert (run_dir / name).is_file(), name
    assert list((run_dir / "tensorboard").iterdir()), "tensorboard events are written when it is installed"
    rows = read_metrics(run_dir)
    assert [int(r["step"]) for r in rows] == list(range(7))
    losses = [float(r["loss"]) for r in rows[1:]]
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0]
    vals = [float(r["val_loss"]) for r in rows if r["val_loss"]]
    assert len(vals) == 3
    assert vals[-1] < vals[0]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2
    assert summary["steps"] == 6
    assert len(summary["corpus_sha256"]) == 64
    assert re.search(r"step\s+6\s+validation loss", proc.stdout)
    # Diagnostics: the resolved setup on screen, per-phase memory of the first steps in a CSV.
    assert "wrap policy layer_policy(Block) matched 2 modules: 2 x Block" in proc.stdout
    assert "[rank 0] 3 units" in proc.stdout
    with open(run_dir / "memory_phases.csv", newline="") as f:
        phases = list(csv.DictReader(f))
    assert [(int(r["step"]), r["phase"]) for r in phases[:4]] == [
        (1, "batch_start"),
        (1, "after_backward"),
        (1, "before_optimizer_step"),
        (1, "batch_end"),
    ]
    assert len(phases) == 12
    assert all(float(r["peak_rss_mib"]) > 0 for r in phases)
    assert "memory per phase" in (run_dir / "logs" / "rank1.log").read_text()
    assert "rank 1 of 2" in (run_dir / "logs" / "rank1.log").read_text()


@pytest.mark.timeout(300)  # three runs
def test_same_seed_same_config_same_loss_curve(tmp_path: Path) -> None:
    curves = []
    # The third run keeps shards, gradients and optimizer state in host memory: the same numerics.
    for name, extra in (("a", []), ("b", []), ("offload", ["trainer.strategy.cpu_offload=true"])):
        proc = shardline_train(
            *SMALL, *GPT_SMALL, *extra, "~callbacks.tensorboard", "~callbacks.loss_plot", run_root=tmp_path / name
        )
        assert proc.returncode == 0, proc.stderr
        rows = read_metrics(only_run_dir(tmp_path / name))
        curves.append([(r["loss"], r["val_loss"], r["grad_norm"]) for r in rows])
    assert curves[0] == curves[1], "bit-identical loss curves (repr of every float)"
    assert curves[2] == curves[0], "CPU offload leaves the loss curve bit-identical"
    log = (only_run_dir(tmp_path / "offload") / "logs" / "rank0.log").read_text()
    assert "CPU offload: sharded parameters, gradients and optimizer state in host memory" in log


def test_the_documented_override_line_runs(tmp_path: Path) -> None:
    proc = shardline_train(
        "experiment=[tiny_gpt,fsdp_args]",
        "trainer.devices=2",
        "trainer.strategy=fsdp",
        "++trainer.precision=bf16-mixed",
        "~callbacks.progress",
        *SMALL,
        *GPT_SMALL,
        run_root=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    run_dir = only_run_dir(tmp_path)
    assert run_dir.parent.name == "tiny_gpt+fsdp_args"
    assert not re.search(r"step\s+\d+\s+validation loss", proc.stdout), "the progress callback was removed"
    assert json.loads((run_dir / "summary.json").read_text())["precision"] == "bf16-mixed"


def test_fp16_mixed_precision_runs_with_a_loss_scaler(tmp_path: Path) -> None:
    proc = shardline_train(
        "experiment=tiny_gpt",
        "trainer.devices=2",
        "trainer.strategy=fsdp",
        "++trainer.precision=16-mixed",
        "trainer.max_steps=3",
        "trainer.val_check_interval=3",
        "trainer.val_batches=1",
        "trainer.micro_batch_size=4",
        "data.max_bytes=300000",
        "data.seq_len=64",
        *GPT_SMALL,
        run_root=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((only_run_dir(tmp_path) / "summary.json").read_text())
    assert summary["precision"] == "16-mixed"
    assert summary["steps"] == 3, summary
    assert math.isfinite(summary["final_train_loss"]), summary


@pytest.mark.parametrize(
    ("strategy", "extra"),
    [("ddp", []), ("zero2", []), ("zero1", []), ("hsdp", ["trainer.strategy.shard_size=1"])],
    ids=["ddp", "zero2", "zero1", "hsdp-2x1"],
)
def test_other_strategies(tmp_path: Path, strategy: str, extra: list[str]) -> None:
    proc = shardline_train(f"trainer.strategy={strategy}", *extra, *SMALL, *GPT_SMALL, run_root=tmp_path)
    assert proc.returncode == 0, proc.stderr
    run_dir = only_run_dir(tmp_path)
    assert strategy in json.loads((run_dir / "summary.json").read_text())["strategy"]
    if strategy == "hsdp":  # two replicas of a one-rank shard group: the 2-D mesh reached the engine
        assert "hybrid mesh: 2 replicas x 1-rank shard groups" in (run_dir / "logs" / "rank0.log").read_text()
        assert "(shard 1 x replicate 2)" in proc.stdout


def test_single_device_runs_in_process(tmp_path: Path) -> None:
    proc = shardline_train("trainer.strategy=single_device", "trainer.devices=1", *SMALL, *GPT_SMALL, run_root=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((only_run_dir(tmp_path) / "summary.json").read_text())["world_size"] == 1


@pytest.mark.compat
@pytest.mark.timeout(300)  # activation checkpointing recomputes the decoder layers
def test_hugging_face_llama_experiment(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    layer = "transformers.models.llama.modeling_llama.LlamaDecoderLayer"
    proc = shardline_train(
        "experiment=hf_llama",
        # with activation checkpointing on the decoder layers, which turns the KV cache off
        f"trainer.strategy.activation_checkpointing_policy={{_target_:shardline.layer_policy,_args_:[{layer}]}}",
        "+callbacks.use_cache._target_=tests.train.probes.RecordUseCache",
        *SMALL,
        run_root=tmp_path,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    run_dir = only_run_dir(tmp_path)
    assert run_dir.parent.name == "hf_llama"
    log = (run_dir / "logs" / "rank0.log").read_text()
    assert "sharded into 3 units" in log
    assert "activation checkpointing on 2 modules" in log
    for rank in (0, 1):
        assert json.loads((run_dir / f"use_cache.rank{rank}.json").read_text()) == {"use_cache": False}


def test_a_failing_worker_stops_the_job_with_its_error(tmp_path: Path) -> None:
    start = time.monotonic()
    proc = shardline_train(
        *SMALL, *GPT_SMALL, "+callbacks.crash._target_=tests.train.helpers.CrashOnRank", run_root=tmp_path
    )
    elapsed = time.monotonic() - start
    assert proc.returncode == 1
    assert "worker rank 1 failed: RuntimeError: injected failure on rank 1 at step 2" in proc.stderr
    assert "helpers.py" in proc.stderr, "the worker's traceback is shown"
    assert "logs of every rank" in proc.stderr
    assert elapsed < 60


def test_a_hung_worker_fails_at_the_collective_timeout(tmp_path: Path) -> None:
    start = time.monotonic()
    proc = shardline_train(
        *SMALL,
        *GPT_SMALL,
        "trainer.collective_timeout_s=8",
        "+callbacks.hang._target_=tests.train.helpers.HangOnRank",
        run_root=tmp_path,
    )
    elapsed = time.monotonic() - start
    assert proc.returncode == 1, proc.stderr
    first = error_line(proc.stderr)
    assert "trainer.collective_timeout_s=8" in first, first
    assert "stalled rank 1 (alive, but it never joined the collective)" in first, first
    assert elapsed < 60, f"took {elapsed:.0f}s"


def _curve(run_dir: Path) -> list[tuple[str, ...]]:
    """Each step's newest row (a resumed attempt recomputes the steps after its checkpoint)."""
    newest = {r["step"]: (r["step"], r["loss"], r["val_loss"], r["lr"], r["grad_norm"]) for r in read_metrics(run_dir)}
    return [newest[step] for step in sorted(newest, key=int)]


@pytest.mark.compat
def test_resume_after_a_crash_continues_bit_identically(tmp_path: Path) -> None:
    common = [*SMALL, *GPT_SMALL, "checkpoint.every_n_steps=2", "~callbacks.tensorboard", "~callbacks.loss_plot"]
    straight = shardline_train(*common, "trainer.run_dir=" + str(tmp_path / "a"), run_root=tmp_path)
    assert straight.returncode == 0, straight.stderr

    crashed = shardline_train(
        *common,
        "trainer.run_dir=" + str(tmp_path / "b"),
        "+callbacks.crash._target_=tests.train.helpers.CrashOnRank",
        "+callbacks.crash.step=5",
        run_root=tmp_path,
    )
    assert crashed.returncode == 1
    assert sorted(p.name for p in (tmp_path / "b" / "checkpoints").glob("step-*")) == ["step-2", "step-4"]
    first_attempt = read_metrics(tmp_path / "b")

    resumed = shardline_train(
        *common, "trainer.run_dir=" + str(tmp_path / "b"), "trainer.resume=auto", run_root=tmp_path
    )
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from step 4" in (tmp_path / "b" / "logs" / "rank0.log").read_text()
    assert _curve(tmp_path / "b") == _curve(tmp_path / "a"), "the resumed run must equal the uninterrupted one"
    rows = read_metrics(tmp_path / "b")
    assert rows[: len(first_attempt)] == first_attempt, "the first attempt's rows are kept, never truncated"
    assert {r["attempt"] for r in rows[len(first_attempt) :]} == {"1"}
    assert (tmp_path / "b" / "config.resume-1.yaml").is_file(), "the first attempt's config is kept"

    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    lineage = subprocess.run(
        [sys.executable, "-m", "shardline.cli", "lineage", str(tmp_path / "b"), "--json"],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert lineage.returncode == 0, lineage.stdout + lineage.stderr
    every = json.loads(lineage.stdout)["rows"]
    rows = [r for r in every if r["event"] in (None, "commit")]
    assert [r["step"] for r in rows] == [2, 4, 6]
    assert rows[2]["parent_manifest_sha256"] == rows[1]["manifest_sha256"], "step 6 descends from step 4"
    (restart,) = [r for r in every if r["event"] == "restart"]
    assert json.loads(restart["detail"])["cause"] == "restarted", "same world size, no preemption save: a crash"


def test_divergence_saves_an_on_exception_checkpoint(tmp_path: Path) -> None:
    proc = shardline_train(
        *SMALL,
        *GPT_SMALL,
        "trainer.run_dir=" + str(tmp_path / "run"),
        "+callbacks.poison._target_=tests.train.helpers.PoisonWeights",
        run_root=tmp_path,
    )
    assert proc.returncode == 1
    assert "TrainingDiverged: training loss became nan at step 3" in proc.stderr
    ckpt = tmp_path / "run" / "checkpoints" / "step-2-on_exception"
    assert (ckpt / "manifest.json").is_file()
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    verify = subprocess.run(
        [sys.executable, "-m", "shardline.cli", "verify", str(ckpt)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr
