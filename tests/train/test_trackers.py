"""Experiment trackers and a Hugging Face dataset through ``shardline train``: MLflow read back with its own
client, W&B's offline run read back from its own files, a crash and a resume that continues where it stopped."""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import struct
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.train.test_cli import read_metrics
from tests.train.test_your_data import DOCS, build_tokenizer

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("datasets", "mlflow", "wandb", "tokenizers")),
    reason="needs the [hf], [mlflow] and [wandb] extras",
)

MLFLOW = "shardline.train.trackers.MLflow"
WANDB = "shardline.train.trackers.WandB"


def wandb_records(path: Path) -> list[Any]:
    """The records of a W&B ``.wandb`` file, parsed with W&B's own protobuf classes.

    The file is W&B's 7-byte header then the LevelDB log format: 32 KiB blocks of chunks, each
    a 7-byte header (CRC-32C, length, type: 1 full, 2 first, 3 middle, 4 last) and its bytes.
    """
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", "a W&B transaction log"
    records, pos, block, pieces = [], 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or (kind == 0 and length == 0):  # block trailer or padding
            pos += left
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        pieces = chunk if kind in (1, 2) else pieces + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            records.append(record)
    return records


def _wandb_run(run_dir: Path) -> dict[str, Any]:
    """What one offline run recorded: config, per-step history, the final summary, artifacts, exit code."""
    (log_file,) = (Path(p) for p in glob.glob(str(run_dir / "run-*.wandb")))
    out: dict[str, Any] = {"config": {}, "history": {}, "summary": {}, "artifacts": [], "exit_code": None}
    for record in wandb_records(log_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            out["config"].update({u.key: json.loads(u.value_json) for u in record.run.config.update})
        elif kind == "history":
            row = {(i.key or ".".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item}
            out["history"][row["_step"]] = row
        elif kind == "summary":
            out["summary"].update(
                {(u.key or ".".join(u.nested_key)): json.loads(u.value_json) for u in record.summary.update}
            )
        elif kind == "artifact":
            out["artifacts"].append((record.artifact.type, sorted(e.path for e in record.artifact.manifest.contents)))
        elif kind == "exit":
            out["exit_code"] = record.exit.exit_code
    return out


def test_hf_dataset_with_mlflow_and_wandb_through_a_crash_and_a_resume(
    capsys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run on a parquet dataset, crashed after step 3 and resumed: both trackers got what happened.

    One rank, in this process (``shardline train``'s own path for ``trainer.devices=1``): the data
    split across ranks is the built-in sources' (test_your_data.py), and rank 0 alone logging is
    checked below without a process group.
    """
    import datasets
    import tokenizers
    from mlflow.tracking import MlflowClient

    from shardline.checkpoint.lifecycle.load import load_trainer_state
    from shardline.train.launcher import train

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    tok_path = build_tokenizer(tmp_path / "tokenizer.json")
    vocab = tokenizers.Tokenizer.from_file(str(tok_path)).get_vocab_size()
    rows = datasets.Dataset.from_dict({"id": list(range(len(DOCS))), "body": [d * 3 for d in DOCS]})
    rows.to_parquet(str(tmp_path / "data" / "train-00000.parquet"))
    experiment = tmp_path / "hf_lm.yaml"
    experiment.write_text(
        f"""model:
  _target_: tests.train.user_model.TinyLM
  vocab: {vocab}
  width: 32
data:
  name: hf
  path: {tmp_path / "data"}
  text_column: body
  tokenizer: {tok_path}
  seq_len: 16
  val_every: 6
trainer:
  run_dir: {tmp_path / "run"}
  max_steps: 4
  val_check_interval: 2
  val_batches: 1
  micro_batch_size: 2
  log_every_n_steps: 1
  devices: 1
checkpoint:
  every_n_steps: 2
callbacks:
  mlflow:
    _target_: {MLFLOW}
  wandb:
    _target_: {WANDB}
"""
    )
    common = [f"experiment={experiment}", "~callbacks.tensorboard", "~callbacks.loss_plot", "~callbacks.diagnostics"]
    crash = ["+callbacks.crash._target_=tests.train.helpers.CrashOnStepEnd", "+callbacks.crash.step=3"]
    assert train([*common, *crash]) == 1
    assert "injected failure on rank 0 after step 3" in capsys.readouterr().err
    assert train([*common, "trainer.resume=auto"]) == 0, capsys.readouterr().err
    run_dir = tmp_path / "run"
    assert "resumed from step 2" in (run_dir / "logs" / "rank0.log").read_text()

    # The data: the parquet dataset, its position in each checkpoint; the resumed attempt continued exactly.
    metrics = read_metrics(run_dir)
    first = {r["step"]: r for r in metrics if r["attempt"] == "0"}
    second = {r["step"]: r for r in metrics if r["attempt"] == "1"}
    assert sorted(first, key=int) == ["0", "1", "2", "3"]
    assert sorted(second, key=int) == ["3", "4"]
    assert (second["3"]["loss"], second["3"]["grad_norm"]) == (first["3"]["loss"], first["3"]["grad_norm"]), (
        "step 3 after resuming sees the same batches as before the crash, bit for bit"
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["corpus"].startswith(f"hf {tmp_path / 'data'} column 'body' (tokenizer")
    for step in (2, 4):
        state = load_trainer_state(run_dir / "checkpoints" / f"step-{step}")
        assert state["data"] == {
            "position": step,
            "seed": 1234,
            "fingerprint": summary["corpus_sha256"],
            "global_batch": 4,  # micro-batch 2 x accumulation 2 (the default) x world 1
            "world_size": 1,
        }
    manifest_sha = {
        f"step-{s}": hashlib.sha256((run_dir / "checkpoints" / f"step-{s}" / "manifest.json").read_bytes()).hexdigest()
        for s in (2, 4)
    }

    # MLflow: the local store in the run directory, read back with MLflow's own client.
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("hf_lm")
    runs = sorted(client.search_runs([exp.experiment_id]), key=lambda r: r.info.start_time)
    assert [r.info.status for r in runs] == ["FAILED", "FINISHED"]
    failed, done = runs
    assert failed.data.params["data.name"] == "hf"
    assert failed.data.params["data.text_column"] == "body"
    assert failed.data.params["trainer.max_steps"] == "4"
    assert failed.data.params["model._target_"] == "tests.train.user_model.TinyLM"
    assert done.data.params["trainer.resume"] == "auto"
    for run, attempt in ((failed, first), (done, second)):
        losses = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "loss")}
        assert losses == {int(s): float(r["loss"]) for s, r in attempt.items() if r["loss"]}, "every step, exact"
        vals = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "val_loss")}
        assert vals == {int(s): float(r["val_loss"]) for s, r in attempt.items() if r["val_loss"]}
    assert failed.data.tags["checkpoint/step-2/manifest_sha256"] == manifest_sha["step-2"]
    assert "checkpoint/step-4/manifest_sha256" not in failed.data.tags
    assert done.data.tags["checkpoint/step-4/manifest_sha256"] == manifest_sha["step-4"]
    assert done.data.tags["shardline.resumed_from_step"] == "2"
    assert done.data.tags["shardline.run_dir"] == str(run_dir)
    assert sorted(a.path for a in client.list_artifacts(done.info.run_id)) == [
        "checkpoint",
        "config.yaml",
        "summary.json",
    ]
    assert [a.path for a in client.list_artifacts(done.info.run_id, "checkpoint")] == ["checkpoint/step-4"]
    report = client.download_artifacts(done.info.run_id, "summary.json", str(tmp_path / "dl"))
    assert json.loads(Path(report).read_text()) == summary, "the run's summary, as summary.json holds it"
    assert [a.path for a in client.list_artifacts(failed.info.run_id)] == ["checkpoint", "config.yaml"]
    assert [a.path for a in client.list_artifacts(failed.info.run_id, "checkpoint")] == ["checkpoint/step-2"]

    # W&B: two offline runs in the run directory, read back from W&B's own transaction logs.
    offline = sorted(glob.glob(str(run_dir / "wandb" / "offline-run-*")))
    assert len(offline) == 2, offline
    runs_wb = sorted((_wandb_run(Path(p)) for p in offline), key=lambda r: r["exit_code"], reverse=True)
    crashed_wb, done_wb = runs_wb
    assert (crashed_wb["exit_code"], done_wb["exit_code"]) == (1, 0)
    assert crashed_wb["config"]["data.name"] == "hf"
    assert crashed_wb["config"]["trainer.max_steps"] == "4"
    for run, attempt in ((crashed_wb, first), (done_wb, second)):
        logged = {step: row["loss"] for step, row in run["history"].items() if "loss" in row}
        assert logged == {int(s): float(r["loss"]) for s, r in attempt.items() if r["loss"]}
    assert crashed_wb["summary"]["checkpoint/step-2/manifest_sha256"] == manifest_sha["step-2"]
    assert done_wb["summary"]["checkpoint/step-4/manifest_sha256"] == manifest_sha["step-4"]
    manifest_files = ["files.table.json", "manifest.json"]
    assert done_wb["artifacts"] == [
        ("checkpoint-manifest", manifest_files),
        ("run-report", ["config.yaml", "summary.json"]),
    ]
    assert crashed_wb["artifacts"] == [("checkpoint-manifest", manifest_files)]


def test_a_missing_tracker_package_is_one_error_naming_the_extra(
    capsys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shardline.train.launcher import train

    def refused(*overrides: str) -> str:
        code = train([f"trainer.run_root={tmp_path / 'runs'}", "trainer.max_steps=1", *overrides])
        err = capsys.readouterr().err
        assert code == 2, err
        assert err.count("\n") == 1, f"one line, got:\n{err}"
        assert not (tmp_path / "runs").exists(), "no run directory: no worker started"
        return err

    assert "callbacks.wandb.mode='cloud'; use one of offline, online, disabled" in refused(
        f"+callbacks.wandb._target_={WANDB}", "+callbacks.wandb.mode=cloud"
    )
    assert "is an MLflow file store, which this MLflow refuses unless MLFLOW_ALLOW_FILE_STORE=true" in refused(
        f"+callbacks.mlflow._target_={MLFLOW}", f"+callbacks.mlflow.tracking_uri=file://{tmp_path}/mlruns"
    )
    for module in ("mlflow", "wandb"):
        monkeypatch.setitem(sys.modules, module, None)  # as if the extra were not installed
    target = {"mlflow": MLFLOW, "wandb": WANDB}
    for name in ("mlflow", "wandb"):
        err = refused(f"+callbacks.{name}._target_={target[name]}")
        assert (
            f'error: callbacks.{name}: needs the {name} package, which is not installed: pip install "shardline[{name}]"'
            in err
        )


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Nothing leaves the machine and nothing lands in the home directory (inherited by the workers)."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)


def test_only_rank_0_talks_to_the_tracker(tmp_path: Path) -> None:
    """On any other rank every hook returns at once: no store, no run, no file (it reads nothing but is_rank0)."""
    from types import SimpleNamespace

    from shardline.train.trackers import MLflow, WandB

    rank1 = SimpleNamespace(is_rank0=False)
    step = SimpleNamespace(step=1, loss=1.0, val_loss=None)
    for tracker in (MLflow(), WandB()):
        tracker.on_fit_start(rank1)
        tracker.on_validation_end(rank1, 0, 1.0)
        tracker.on_step_end(rank1, step)
        tracker.on_exception(rank1, RuntimeError("x"))
        tracker.on_fit_end(rank1, SimpleNamespace(to_dict=dict))
    assert not list(tmp_path.iterdir())


def test_a_tracker_that_fails_ends_the_run_naming_it(capsys, tmp_path: Path) -> None:
    """The tracker works on a background thread; its failure is raised on rank 0 at the next hook: exit 1, named."""
    from shardline.train.launcher import train
    from tests.train.test_cli import GPT_SMALL, SMALL

    (tmp_path / "a-file").write_text("not a folder")
    code = train(
        [
            f"trainer.run_root={tmp_path / 'runs'}",
            *SMALL,
            *GPT_SMALL,
            "trainer.devices=1",
            "trainer.strategy=single_device",
            "~callbacks.tensorboard",
            "~callbacks.loss_plot",
            "~callbacks.diagnostics",
            f"+callbacks.mlflow._target_={MLFLOW}",
            f"+callbacks.mlflow.tracking_uri=sqlite:///{tmp_path / 'a-file' / 'mlflow.db'}",
        ]
    )
    err = capsys.readouterr().err
    assert code == 1, err
    assert "rank 0 failed: TrackerError: callbacks.mlflow: " in err.splitlines()[0], err
