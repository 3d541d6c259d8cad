"""``tracker_send``'s W&B functions, which the HF and Lightning front ends use on a run they did not open: the run
tags added to the run's own tags and summary, and a checkpoint's record as summary entries and a manifest artifact,
read back from W&B's offline transaction log with W&B's own protobuf classes."""

from __future__ import annotations

import base64
import glob
import hashlib
import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from shardline.checkpoint import CheckpointManager, SaveRequest
from shardline.checkpoint.provenance.tracker_record import tracker_record
from shardline.checkpoint.provenance.tracker_send import wandb_checkpoints, wandb_run_tags

pytestmark = pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="needs the [wandb] extra")


def test_wandb_run_gets_the_run_tags_beside_its_own_and_the_checkpoint_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import wandb

    from tests.train.test_trackers import wandb_records

    for name in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    CheckpointManager(tmp_path / "ckpt", tags={"ticket": "WB-5"}).save(SaveRequest(model=torch.nn.Linear(4, 3), step=1))
    record = tracker_record(tmp_path / "ckpt" / "step-1")
    run = wandb.init(
        mode="offline", dir=str(tmp_path), project="p", tags=["theirs"], settings=wandb.Settings(silent=True)
    )
    try:
        wandb_run_tags(run, {"ticket": "WB-5", "owner": "x" * 70})
        wandb_run_tags(run, {"ticket": "WB-5"})  # again: nothing doubled
        wandb_checkpoints(run, [record])
    finally:
        run.finish()

    (log_file,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    records = wandb_records(Path(log_file))
    tags = [list(r.run.tags) for r in records if r.WhichOneof("record_type") == "run"][-1]
    assert tags == ["theirs", "ticket:WB-5", "owner:" + "x" * 55 + "..."]  # W&B's 64 characters a tag
    summary: dict[str, Any] = {}
    for r in records:
        if r.WhichOneof("record_type") == "summary":
            summary.update({u.key: json.loads(u.value_json) for u in r.summary.update})
    assert summary["run_tags/owner"] == "x" * 70
    assert summary["checkpoint/step-1/manifest_sha256"] == record.manifest_sha256
    assert summary["checkpoint/step-1/parent_manifest_sha256"] == "none"
    (artifact,) = [r.artifact for r in records if r.WhichOneof("record_type") == "artifact"]
    contents = {e.path: e for e in artifact.manifest.contents}
    raw = (tmp_path / "ckpt" / "step-1" / "manifest.json").read_bytes()
    assert contents["manifest.json"].digest == base64.b64encode(hashlib.md5(raw).digest()).decode()
    assert json.loads(artifact.metadata)["run_tags/ticket"] == "WB-5"
