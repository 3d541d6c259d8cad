"""``shardline train`` with ``checkpoint.dir=s3://...``: real workers, the session SeaweedFS server.

One bucket run and one local run of the same schedule (W=2, then ``trainer.resume=auto`` at W=1):
the same losses bit for bit (the same ops run on the same bytes; only where they are stored
differs), and the same consolidated weights; a bad bucket stops the launcher before any worker.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from safetensors.torch import load_file

from shardline import cli
from shardline.checkpoint.provenance.ledger import Ledger
from shardline.train.checkpointing import find_resumable_run
from shardline.train.records import recorded_checkpoint_dirs
from tests.checkpoint.conftest import S3_BUCKET
from tests.checkpoint.seaweed import S3Server
from tests.train.test_cli import GPT_SMALL, PYTHONPATH, ROOT, SMALL, _curve, error_line, shardline_train

pytestmark = pytest.mark.timeout(120)

COMMON = [*SMALL, *GPT_SMALL, "~callbacks.tensorboard", "~callbacks.loss_plot"]


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    cmd = [sys.executable, "-m", "shardline.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)


def _train_then_resume_at_one_worker(tmp_path: Path, name: str, where: list[str]) -> Path:
    run_dir = tmp_path / name
    first = shardline_train(*COMMON, "trainer.max_steps=3", f"trainer.run_dir={run_dir}", *where, run_root=tmp_path)
    assert first.returncode == 0, first.stderr
    second = shardline_train(
        *COMMON,
        "trainer.strategy=single_device",
        "trainer.devices=1",
        "trainer.resume=auto",
        f"trainer.run_dir={run_dir}",
        *where,
        run_root=tmp_path,
    )
    assert second.returncode == 0, second.stderr
    assert "resumed from step 3" in (run_dir / "logs" / "rank0.log").read_text()
    return run_dir


def test_train_to_a_bucket_resume_at_another_world_size_like_local(
    s3_env: S3Server, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    url = f"s3://{S3_BUCKET}/train-{uuid.uuid4().hex[:12]}"
    # The bucket run saves in the background and keeps only the newest checkpoint; the local one does neither.
    into_bucket = [f"checkpoint.dir={url}", "checkpoint.async_save=true", "checkpoint.keep_last_n=1"]
    bucket_run = _train_then_resume_at_one_worker(tmp_path, "bucket", into_bucket)
    local_run = _train_then_resume_at_one_worker(tmp_path, "local", [])

    # Every checkpoint went to the bucket, committed (manifest present); step-3, resumed from, was deleted after
    # step-6 committed (keep_last_n=1), its tombstone in the local ledger; nothing under the run directory.
    fs = s3_env.filesystem()
    key = url.removeprefix("s3://")
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(key)) == ["step-6"]
    assert fs.isfile(f"{key}/step-6/manifest.json")
    assert not (bucket_run / "checkpoints").exists()
    buried = [r for r in Ledger(bucket_run / "lineage.sqlite").rows() if r.event == "tombstone"]
    assert [(r.step, r.checkpoint) for r in buried] == [(3, f"{url}/step-3")]

    # The same training: bit-identical loss curves (same ops on the same bytes, wherever and however they were
    # stored: async saves with host staging resume exactly what a synchronous save would).
    assert _curve(bucket_run) == _curve(local_run)

    # The ledger stays local and names the checkpoints by URL, chained across the resume.
    rows = [r for r in Ledger(bucket_run / "lineage.sqlite").rows() if r.is_commit]
    assert [(r.step, r.checkpoint, r.world_size) for r in rows] == [
        (3, f"{url}/step-3", 2),
        (6, f"{url}/step-6", 1),
    ]
    assert rows[1].parent_manifest_sha256 == rows[0].manifest_sha256
    restart = [r for r in Ledger(bucket_run / "lineage.sqlite").rows() if r.event == "restart"]
    assert [(r.checkpoint, json.loads(r.detail or "{}")["checkpoint"]) for r in restart] == [
        (f"{url}/step-3", f"{url}/step-3")
    ]
    assert json.loads(restart[0].detail or "{}")["cause"] == "node_lost"
    manifest = json.loads(fs.cat_file(f"{key}/step-6/manifest.json"))
    assert manifest["parent_manifest_sha256"] == rows[0].manifest_sha256

    # The audit commands on the run directory: the bucket prefix (from the rows and the run's config.yaml) listed,
    # the chain verifies with step-3's tombstone, step-6 verified in the bucket, step-3 reported deleted.
    assert recorded_checkpoint_dirs(bucket_run) == [url]
    assert cli.main(["lineage", str(bucket_run)]) == 0
    assert f"and the bucket prefix {url}/ (endpoint {s3_env.endpoint}) is in the chain." in capsys.readouterr().out
    assert cli.main(["report", str(bucket_run)]) == 0
    assert "2 checkpoint(s), 1 verified, 1 deleted by retention" in capsys.readouterr().out

    # resume=auto without trainer.run_dir finds the run whose local ledger records checkpoints under the URL.
    runs = tmp_path / "runs" / "tiny_gpt"
    shutil.copytree(bucket_run, runs / "20260101-000000")
    shutil.copytree(local_run, runs / "20260101-000001")  # newer, but its checkpoints are elsewhere
    assert find_resumable_run(tmp_path / "runs", "tiny_gpt", checkpoint_dir=url) == runs / "20260101-000000"
    assert find_resumable_run(tmp_path / "runs", "tiny_gpt", checkpoint_dir=f"{url}-other") is None
    assert find_resumable_run(tmp_path / "runs", "tiny_gpt") == runs / "20260101-000001"

    # Consolidating the final checkpoint from the bucket gives the local run's weights, byte for byte.
    out_bucket, out_local = tmp_path / "bucket.safetensors", tmp_path / "local.safetensors"
    done = _cli("consolidate", f"{url}/step-6", str(out_bucket))
    assert done.returncode == 0, done.stdout + done.stderr
    done = _cli("consolidate", str(local_run / "checkpoints" / "step-6"), str(out_local))
    assert done.returncode == 0, done.stdout + done.stderr
    bucket_weights, local_weights = load_file(out_bucket), load_file(out_local)
    assert bucket_weights
    assert bucket_weights.keys() == local_weights.keys()
    for name, tensor in local_weights.items():
        assert bucket_weights[name].dtype == tensor.dtype
        assert bucket_weights[name].equal(tensor), name


def test_bad_bucket_stops_the_launcher_with_exit_2(s3_env: S3Server, tmp_path: Path) -> None:
    proc = shardline_train(*COMMON, "checkpoint.dir=s3://no-such-bucket-22/run", run_root=tmp_path, timeout=90)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = error_line(proc.stderr)
    assert "'no-such-bucket-22'" in line
    assert s3_env.endpoint in line
    assert "does not exist" in line
    assert not list(tmp_path.glob("*/*/logs/rank*.log")), "no worker started"

    # Refused credentials (a wrong secret in checkpoint.storage_options): exit 2, naming bucket and endpoint.
    wrong = [
        f"+checkpoint.storage_options.endpoint_url={s3_env.endpoint}",
        "+checkpoint.storage_options.key=wrong-key",
        "+checkpoint.storage_options.secret=wrong-secret",
    ]
    proc = shardline_train(*COMMON, f"checkpoint.dir=s3://{S3_BUCKET}/run", *wrong, run_root=tmp_path, timeout=90)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = error_line(proc.stderr)
    assert "refused" in line
    assert S3_BUCKET in line
    assert s3_env.endpoint in line
