"""``shardline.lightning.DiagnosticsCallback`` and ``shardline.hf.DiagnosticsCallback``: ``shardline train``'s
diagnostics (what was resolved, per-rank share, memory per phase, the first step's collectives) under Lightning and
HF Trainer, read back from the MLflow run each front end's tracker wrote (MLflow's own client; Lightning's
TensorBoard logger with TensorBoard's own event reader). The same launches save checkpoints with run tags: each
committed checkpoint's tracker record (manifest artifact, file table, sharding, parent) and the run tags are read
back from the same runs."""

from __future__ import annotations

import csv
import hashlib
import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from shardline.testing import run_distributed
from tests.diagnostics import frontend_ranks

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("mlflow", "lightning", "transformers", "tensorboard")),
    reason="needs the [mlflow], [lightning] and [hf] extras",
)


def _read_back(root: Path, run_id: str, tmp_path: Path) -> tuple[str, dict[str, dict[int, float]]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{root}/mlflow.db")
    text = Path(client.download_artifacts(run_id, "diagnostics.txt", str(tmp_path))).read_text()
    run = client.get_run(run_id)
    history = {
        key: {m.step: m.value for m in client.get_metric_history(run_id, key)}
        for key in run.data.metrics
        if key.startswith("diagnostics/")
    }
    return text, history


@pytest.fixture(scope="module")
def lightning_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """One Lightning launch (4 steps under ShardlineStrategy, checkpoints at 2 and 4, run tags, MLflow and
    TensorBoard loggers)."""
    root = tmp_path_factory.mktemp("lit")
    (out,) = run_distributed(frontend_ranks.lightning_fit, 1, args=(str(root),), timeout=120)
    return root, out


def test_lightning_callback_logs_the_train_diagnostics_to_its_logger(
    lightning_run: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    root, out = lightning_run
    text, history = _read_back(root, out["run_id"], tmp_path / "dl")
    assert text == out["text"]
    assert "strategy shardline (full_shard), world size 1" in text
    assert "3 units over 1 ranks" in text
    assert "wrap policy layer_policy(Block) matched 2 modules: 2 x Block" in text
    assert "checkpoint state-dict kind: sharded" in text
    assert "[rank 0] 3 units, 0 activation-checkpointed modules" in text
    assert "collectives in one step:" in text
    assert "memory per phase" in text
    phases = ("batch_start", "after_backward", "before_optimizer_step", "batch_end")
    for phase in phases:
        assert set(history[f"diagnostics/peak_rss_mib/{phase}"]) == {1, 2}, phase
        assert all(v > 0 for v in history[f"diagnostics/peak_rss_mib/{phase}"].values())
        assert set(history[f"diagnostics/engine_mib/{phase}"]) == {1, 2}
    folder = next(root.rglob("memory_phases.csv")).parent
    with open(folder / "memory_phases.csv", newline="") as f:
        rows = [(int(r["step"]), r["phase"]) for r in csv.DictReader(f)]
    assert rows == [(s, p) for s in (1, 2) for p in phases]
    assert (folder / "diagnostics.txt").read_text() == text
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next(root.rglob("events.out.tfevents.*")).parent), size_guidance={"tensors": 0})
    events.Reload()
    (entry,) = events.Tensors("diagnostics/text_summary")
    assert entry.tensor_proto.string_val[0].decode() == "```\n" + text + "```"
    assert sorted(e.step for e in events.Scalars("diagnostics/peak_rss_mib/batch_end")) == [1, 2]


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """One ShardlineTrainer launch (4 steps, checkpoints at 2 and 4, run tags, MLflow and TensorBoard)."""
    root = tmp_path_factory.mktemp("hf")
    (out,) = run_distributed(frontend_ranks.hf_train, 1, args=(str(root),), timeout=120)
    return root, out


def test_hf_callback_logs_the_train_diagnostics_to_the_mlflow_run_report_to_started(
    hf_run: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    root, out = hf_run
    assert out["run_id"], "report_to=['mlflow'] opened a run"
    text, history = _read_back(root, out["run_id"], tmp_path / "dl")
    assert text == out["text"]
    assert "strategy ShardlineTrainer (full_shard), world size 1" in text
    assert "3 units over 1 ranks" in text
    assert "wrap policy layer_policy(LlamaDecoderLayer) matched 2 modules: 2 x LlamaDecoderLayer" in text
    assert "trainer.precision=32-true: no autocast" in text
    assert "collectives in one step:" in text
    assert "memory per phase" in text
    for phase in ("batch_start", "before_optimizer_step", "batch_end"):
        assert set(history[f"diagnostics/peak_rss_mib/{phase}"]) == {1, 2}, phase
    with open(root / "out" / "memory_phases.csv", newline="") as f:
        assert [(int(r["step"]), r["phase"]) for r in csv.DictReader(f)] == [
            (s, p) for s in (1, 2) for p in ("batch_start", "before_optimizer_step", "batch_end")
        ]


def _files(manifest: dict[str, Any]) -> list[list[Any]]:
    return sorted([[f["rank"], f["path"], f["bytes"], f["sha256"]] for f in manifest["files"]], key=lambda r: r[1])


def assert_checkpoints_in_mlflow(
    db: Path,
    run_id: str | None,
    experiment: str,
    ticket: str,
    checkpoints: dict[str, Path],
    tmp_path: Path,
    *,
    parent: str = "none",
) -> str:
    """Each checkpoint's record in the MLflow run, read back with MlflowClient, against its manifest on disk; the
    run (``run_id``; None: any one run) found by its ticket tag, and its id returned; the parent tags chained in the
    order given, from ``parent``."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    exp = client.get_experiment_by_name(experiment)
    (found,) = client.search_runs([exp.experiment_id], filter_string=f"tags.ticket = '{ticket}'")
    assert run_id in (None, found.info.run_id)
    run_id = found.info.run_id
    assert client.search_runs([exp.experiment_id], filter_string="tags.ticket = 'nope'") == []
    tags = client.get_run(run_id).data.tags
    for name, folder in checkpoints.items():
        raw = (folder / "manifest.json").read_bytes()
        manifest, digest = json.loads(raw), hashlib.sha256(raw).hexdigest()
        assert manifest["run_tags"] == {"ticket": ticket}, "the manifest records the run tags"
        assert tags[f"checkpoint/{name}/manifest_sha256"] == digest
        assert tags[f"checkpoint/{name}/parent_manifest_sha256"] == parent
        assert tags[f"checkpoint/{name}/files"] == str(len(manifest["files"]))
        assert tags[f"checkpoint/{name}/world_size"] == str(manifest["world_size"])
        assert tags[f"checkpoint/{name}/step"] == str(manifest["step"])
        got = Path(client.download_artifacts(run_id, f"checkpoint/{name}/manifest.json", str(tmp_path)))
        assert got.read_bytes() == raw, "the manifest byte for byte"
        table = json.loads(
            Path(client.download_artifacts(run_id, f"checkpoint/{name}/files.json", str(tmp_path))).read_text()
        )
        assert table["columns"] == ["rank", "path", "bytes", "sha256"]
        assert sorted(table["data"], key=lambda r: r[1]) == _files(manifest)
        parent = digest
    return run_id


def test_hf_trainer_records_each_checkpoint_and_the_run_tags_in_mlflow_and_tensorboard(
    hf_run: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    root, out = hf_run
    checkpoints = {f"checkpoint-{n}": root / "out" / f"checkpoint-{n}" / "shardline" for n in (2, 4)}
    assert_checkpoints_in_mlflow(root / "mlflow.db", out["run_id"], "hf", "HF-7", checkpoints, tmp_path)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(
        str(next((root / "out").rglob("events.out.tfevents.*")).parent), size_guidance={"tensors": 0}
    )
    events.Reload()
    (event,) = events.Tensors("checkpoint/checkpoint-4/text_summary")
    digest = hashlib.sha256((checkpoints["checkpoint-4"] / "manifest.json").read_bytes()).hexdigest()
    assert event.step == 4
    assert f"manifest `{digest}`" in event.tensor_proto.string_val[0].decode()
    assert "| tag ticket | `HF-7` |" in event.tensor_proto.string_val[0].decode()
    (tags,) = events.Tensors("run_tags/text_summary")
    assert "| ticket | `HF-7` |" in tags.tensor_proto.string_val[0].decode()


def test_lightning_strategy_records_each_checkpoint_and_the_run_tags_in_its_loggers(
    lightning_run: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    root, out = lightning_run
    folders = {n: root / "ckpt" / f"epoch=0-step={n}.ckpt" for n in (2, 4)}
    checkpoints = {f"epoch_0-step_{n}.ckpt": folder for n, folder in folders.items()}
    assert_checkpoints_in_mlflow(root / "mlflow.db", out["run_id"], "lit", "LIT-3", checkpoints, tmp_path)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next(root.rglob("events.out.tfevents.*")).parent), size_guidance={"tensors": 0})
    events.Reload()
    (event,) = events.Tensors("checkpoint/epoch_0-step_4.ckpt/text_summary")
    digest = hashlib.sha256((folders[4] / "manifest.json").read_bytes()).hexdigest()
    assert event.step == 4
    assert f"manifest `{digest}`" in event.tensor_proto.string_val[0].decode()
    (tags,) = events.Tensors("run_tags/text_summary")
    assert "| ticket | `LIT-3` |" in tags.tensor_proto.string_val[0].decode()
