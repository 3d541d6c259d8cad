"""What MLflow, W&B and TensorBoard show for each checkpoint of a ``shardline train`` run, the run tags that
find it from either side, and the diagnostics that go with the run: read back with MLflow's own client, from W&B's offline transaction log (its own
protobuf records) and with TensorBoard's own event reader."""

from __future__ import annotations

import base64
import glob
import hashlib
import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from tests.train.test_cli import GPT_SMALL
from tests.train.test_trackers import wandb_records

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("mlflow", "wandb", "tensorboard", "pandas")),
    reason="needs the [mlflow], [wandb] and [tensorboard] extras",
)

TAGS = {"owner": "bob", "project": "lm", "ticket": "ABC-1"}


def _files(manifest: dict[str, Any]) -> list[list[Any]]:
    return sorted([[f["rank"], f["path"], f["bytes"], f["sha256"]] for f in manifest["files"]], key=lambda r: r[1])


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One run of two steps, a checkpoint after each, with MLflow, W&B and TensorBoard; tags from YAML and CLI."""
    from shardline.train.launcher import train

    tmp = tmp_path_factory.mktemp("tracked")
    mp = pytest.MonkeyPatch()
    mp.setenv("WANDB_CACHE_DIR", str(tmp / "wandb-cache"))
    mp.setenv("WANDB_CONFIG_DIR", str(tmp / "wandb-config"))
    mp.setenv("WANDB_DATA_DIR", str(tmp / "wandb-data"))
    mp.delenv("WANDB_MODE", raising=False)
    mp.delenv("MLFLOW_TRACKING_URI", raising=False)
    experiment = tmp / "tagged.yaml"
    experiment.write_text(
        """tracking:
  tags:
    project: lm
    owner: ana
"""
    )
    run_dir = tmp / "run"
    try:
        code = train(
            [
                "experiment=[tiny_gpt," + str(experiment) + "]",
                f"trainer.run_dir={run_dir}",
                "trainer.max_steps=2",
                "trainer.val_check_interval=2",
                "trainer.val_batches=1",
                "trainer.micro_batch_size=2",
                "trainer.log_every_n_steps=1",
                "trainer.devices=1",
                "data.max_bytes=20000",
                "data.seq_len=32",
                *GPT_SMALL,
                "checkpoint.every_n_steps=1",
                "tracking.tags.ticket=ABC-1",
                "tracking.tags.owner=bob",  # the command line wins over the YAML
                "~callbacks.loss_plot",
                "+callbacks.mlflow._target_=shardline.train.trackers.MLflow",
                "+callbacks.wandb._target_=shardline.train.trackers.WandB",
            ]
        )
    finally:
        mp.undo()
    assert code == 0
    return run_dir


def _manifests(run_dir: Path) -> dict[str, tuple[bytes, dict[str, Any], str]]:
    out = {}
    for step in (1, 2):
        raw = (run_dir / "checkpoints" / f"step-{step}" / "manifest.json").read_bytes()
        out[f"step-{step}"] = (raw, json.loads(raw), hashlib.sha256(raw).hexdigest())
    return out


def test_checkpoints_record_the_run_tags_in_manifest_and_statement(tracked_run: Path) -> None:
    from shardline.checkpoint import verify_checkpoint

    for name, (_raw, manifest, _digest) in _manifests(tracked_run).items():
        assert manifest["run_tags"] == TAGS, name
        statement = json.loads((tracked_run / "checkpoints" / name / "provenance.intoto.json").read_bytes())
        assert statement["predicate"]["run_tags"] == TAGS
        report = verify_checkpoint(tracked_run / "checkpoints" / name)
        assert report.ok, report.problems


def test_mlflow_finds_the_run_by_ticket_and_shows_each_checkpoint(tracked_run: Path, tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tracked_run / 'mlflow' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("tiny_gpt+tagged")
    (run,) = client.search_runs([exp.experiment_id], filter_string="tags.ticket = 'ABC-1'")
    assert client.search_runs([exp.experiment_id], filter_string="tags.ticket = 'ABC-2'") == []
    assert {k: run.data.tags[k] for k in TAGS} == TAGS
    assert run.data.params["tracking.tags.ticket"] == "ABC-1"
    manifests = _manifests(tracked_run)
    for name, (raw, manifest, digest) in manifests.items():
        tags = {k.removeprefix(f"checkpoint/{name}/"): v for k, v in run.data.tags.items() if f"/{name}/" in k}
        parent = manifests["step-1"][2] if name == "step-2" else "none"
        assert tags == {
            "manifest_sha256": digest,
            "parent_manifest_sha256": parent,
            "step": name.removeprefix("step-"),
            "files": str(len(manifest["files"])),
            "bytes": str(sum(f["bytes"] for f in manifest["files"])),
            "world_size": "1",
            "mesh": "dp=1",
            "strategy": "full_shard",
            "state_dict_kind": "sharded",
            "engine": "shardline",
        }
        got = Path(client.download_artifacts(run.info.run_id, f"checkpoint/{name}/manifest.json", str(tmp_path)))
        assert got.read_bytes() == raw, "the manifest byte for byte: its sha256 is the manifest hash"
        table = json.loads(
            Path(client.download_artifacts(run.info.run_id, f"checkpoint/{name}/files.json", str(tmp_path))).read_text()
        )
        assert table["columns"] == ["rank", "path", "bytes", "sha256"]
        assert sorted(table["data"], key=lambda r: r[1]) == _files(manifest)

    # The diagnostics callback's findings (shardline train's on-screen diagnostics) go to the run too.
    text = Path(client.download_artifacts(run.info.run_id, "diagnostics.txt", str(tmp_path))).read_text()
    assert "wrap policy layer_policy(Block) matched 2 modules: 2 x Block" in text
    assert "[rank 0] 3 units" in text
    assert "memory per phase" in text
    for phase in ("batch_start", "after_backward", "before_optimizer_step", "batch_end"):
        history = client.get_metric_history(run.info.run_id, f"diagnostics/peak_rss_mib/{phase}")
        assert sorted(m.step for m in history) == [1, 2], phase


def test_wandb_offline_run_holds_the_tags_and_a_manifest_artifact_per_checkpoint(tracked_run: Path) -> None:
    (log_file,) = (Path(p) for p in glob.glob(str(tracked_run / "wandb" / "offline-run-*" / "run-*.wandb")))
    records = wandb_records(log_file)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert {"ticket:ABC-1", "owner:bob", "project:lm"} <= set(run.tags)
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert config["tracking.tags.ticket"] == "ABC-1"
    summary: dict[str, Any] = {}
    for r in records:
        if r.WhichOneof("record_type") == "summary":
            summary.update({u.key: json.loads(u.value_json) for u in r.summary.update})
    assert "wrap policy layer_policy(Block) matched 2 modules" in summary["diagnostics"]
    assert summary["diagnostics/peak_rss_mib/batch_end"] > 0
    artifacts = [r.artifact for r in records if r.WhichOneof("record_type") == "artifact"]
    manifests = _manifests(tracked_run)
    for name, (raw, manifest, digest) in manifests.items():
        assert summary[f"checkpoint/{name}/manifest_sha256"] == digest
        assert summary[f"checkpoint/{name}/strategy"] == "full_shard"
        (artifact,) = [a for a in artifacts if a.type == "checkpoint-manifest" and a.name.endswith(name)]
        contents = {e.path: e for e in artifact.manifest.contents}
        assert sorted(contents) == ["files.table.json", "manifest.json"]
        md5 = base64.b64encode(hashlib.md5(raw).digest()).decode()
        assert contents["manifest.json"].digest == md5, "the manifest byte for byte"
        metadata = json.loads(artifact.metadata)
        assert metadata[f"checkpoint/{name}/manifest_sha256"] == digest
        assert metadata["run_tags/ticket"] == "ABC-1"
        table = json.loads(Path(contents["files.table.json"].local_path).read_text())
        assert table["columns"] == ["rank", "path", "bytes", "sha256"]
        assert sorted(table["data"], key=lambda r: r[1]) == _files(manifest)


def test_tensorboard_text_tab_shows_each_checkpoint_as_a_table(tracked_run: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tracked_run / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    for name, (_raw, manifest, digest) in _manifests(tracked_run).items():
        (event,) = events.Tensors(f"checkpoint/{name}/text_summary")
        text = event.tensor_proto.string_val[0].decode()
        assert event.step == int(name.removeprefix("step-"))
        assert f"manifest `{digest}`" in text
        assert "| tag ticket | `ABC-1` |" in text
        for rank, path, size, sha in _files(manifest):
            assert f"| {rank} | {path} | {size} | `{sha}` |" in text
