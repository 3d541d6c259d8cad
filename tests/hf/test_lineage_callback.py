"""``shardline.hf.LineageCallback`` on ``transformers.Trainer`` with its own FSDP (``fsdp=``), at W=2 on CPU.

Two torchrun launches (tests/hf/lineage_script.py says what each runs; its note says how Accelerate's
FSDP path is made to run on CPU): the first trains ``plain`` (no callback: the framework's own
checkpoints), ``lined`` (the callback) and ``rotated`` (``save_total_limit=1``); the second, a fresh
set of processes, resumes ``lined/checkpoint-2`` -- first with a byte of its model shard flipped,
then intact. The checks:

* the callback changes nothing of training: ``lined`` ends with ``plain``'s weights, bit for bit;
* each ``checkpoint-N`` is adopted at its save: it verifies, every file of it is in its manifest,
  its ledger row is marked adopted, the saves are chained (and chained to the resumed checkpoint);
* the resume in new processes ends with the uninterrupted run's weights, bit for bit; the later
  checkpoint of the abandoned branch is moved aside and recorded; the flipped byte stops the
  resume on every rank with an IntegrityError naming the file;
* checkpoints Trainer's rotation deleted get tombstone rows; the ledger verifies;
* each adopted checkpoint is recorded in the MLflow run ``report_to`` started, which its run tag finds.

Without a launch: what the callback refuses (arguments that save no DCP folders, a resume from a
checkpoint not under lineage, a fresh start over adopted checkpoints).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")

from accelerate.utils import FullyShardedDataParallelPlugin
from transformers import TrainerControl, TrainerState, TrainingArguments

import shardline.checkpoint as ckpt
from shardline import cli
from shardline.checkpoint.integrity.manifest import read_manifest
from shardline.checkpoint.lifecycle.adopt import ADOPTED_HASHES
from shardline.checkpoint.provenance.records import adoption
from shardline.distributed import free_port
from shardline.errors import CheckpointExistsError, CheckpointNotFoundError, ConfigurationError
from shardline.hf import LineageCallback

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "hf" / "lineage_script.py"

pytestmark = [
    pytest.mark.compat,  # Trainer's and Accelerate's FSDP checkpoints, on the installed releases
    # FSDP1 cannot be tested on CPU: Accelerate's FSDP1 plugin asks for a GPU-type device when it is built.
    pytest.mark.skipif(
        "fsdp_version" not in {f.name for f in dataclasses.fields(FullyShardedDataParallelPlugin)},
        reason="the installed accelerate has no FSDP2 (fsdp_version)",
    ),
]


def _launch(phase: str, out: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(SCRIPT), phase, str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=out, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fsdp")
    _launch("train", out)
    saved = {step: read_manifest(out / "lined" / f"checkpoint-{step}")[1] for step in (2, 4)}
    (out / "saved.json").write_text(json.dumps(saved))  # the first run's manifest hashes, before the resume
    _launch("resume", out)
    return out


def _weights(out: Path, name: str) -> dict[str, torch.Tensor]:
    return torch.load(out / f"{name}.weights.pt", weights_only=True)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_trainer_fsdp_checkpoints_are_adopted_chained_and_resumed_bit_identically(fsdp_runs: Path) -> None:
    out = fsdp_runs
    lined, plain = _weights(out, "lined"), _weights(out, "plain")
    assert len(lined) == 21  # every tensor of the two-layer Llama, gathered from its FSDP2 shards
    assert _same(lined, plain), "the callback changed training"
    assert _same(_weights(out, "resumed"), lined), "the resume in new processes did not reach the same weights"
    saved = {int(k): v for k, v in json.loads((out / "saved.json").read_text()).items()}
    # Each save adopted: verifies, every file listed, honestly labelled, chained.
    folder = out / "lined" / "checkpoint-2"
    manifest, digest = read_manifest(folder)
    assert digest == saved[2]
    assert ckpt.verify_checkpoint(folder).ok
    listed = {f["path"] for f in manifest["files"]}
    on_disk = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    assert listed == on_disk - {"manifest.json", "manifest.sha256", "SHA256SUMS"}
    for name in ("pytorch_model_fsdp_0/__1_0.distcp", "optimizer_0/.metadata", "trainer_state.json",
                 "scheduler.pt", "rng_state_0.pth", "rng_state_1.pth"):  # fmt: skip
        assert name in listed, sorted(listed)
    assert (manifest["world_size"], manifest["step"]) == (2, 2)
    assert manifest["adopted"]["hashes"] == ADOPTED_HASHES
    assert (manifest["contents"]["model"], manifest["contents"]["optimizer"]) == (True, True)
    ledger = ckpt.Ledger(out / "lined" / "lineage.sqlite")
    report = ledger.verify()
    assert report.ok, report.problems
    commits = [(r.checkpoint, r.manifest_sha256, r.parent_manifest_sha256) for r in report.rows if r.is_commit]
    new4 = read_manifest(out / "lined" / "checkpoint-4")[1]
    assert commits == [
        ("checkpoint-2", saved[2], None),
        ("checkpoint-4", saved[4], saved[2]),
        ("checkpoint-4", new4, saved[2]),  # saved again after the resume from checkpoint-2: its parent
    ]
    assert all(adoption(r) is not None for r in report.rows if r.is_commit)
    # The abandoned branch: the first checkpoint-4 moved aside, recorded, still verifying where it is.
    (aside,) = (out / "lined" / "abandoned").iterdir()
    assert read_manifest(aside)[1] == saved[4]
    assert ckpt.verify_checkpoint(aside).ok
    (tomb,) = [r for r in report.rows if r.event == "tombstone"]
    assert (tomb.checkpoint, tomb.manifest_sha256) == ("checkpoint-4", saved[4])
    assert cli.main(["verify", str(out / "lined" / "checkpoint-4")]) == 0
    assert cli.main(["lineage", str(out / "lined")]) == 0


@pytest.mark.slow
def test_a_flipped_byte_in_a_model_shard_stops_the_resume_on_every_rank(fsdp_runs: Path) -> None:
    said = [json.loads((fsdp_runs / f"refused.{rank}.json").read_text()) for rank in (0, 1)]
    assert said[0] == said[1], said
    assert said[0]["type"] == "IntegrityError"
    assert "altered pytorch_model_fsdp_0/__0_0.distcp" in said[0]["message"]
    assert "before its first step" in said[0]["message"]


@pytest.mark.slow
def test_checkpoints_deleted_by_save_total_limit_are_tombstoned(fsdp_runs: Path) -> None:
    run = fsdp_runs / "rotated"
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-3"]
    report = ckpt.Ledger(run / "lineage.sqlite").verify()
    assert report.ok, report.problems
    events = [(r.event, r.checkpoint) for r in report.rows]
    commits = [r for r in report.rows if r.is_commit]
    assert [r.checkpoint for r in commits] == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    assert [r.parent_manifest_sha256 for r in commits] == [None] + [r.manifest_sha256 for r in commits[:2]]
    assert ("tombstone", "checkpoint-1") in events
    assert ("tombstone", "checkpoint-2") in events
    assert ckpt.verify_checkpoint(run / "checkpoint-3").ok


@pytest.mark.slow
def test_adopted_checkpoints_and_the_run_tags_are_recorded_in_the_mlflow_run(fsdp_runs: Path, tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    from tests.diagnostics.test_frontend_callbacks import assert_checkpoints_in_mlflow

    run = fsdp_runs / "rotated"
    commits = [r for r in ckpt.Ledger(run / "lineage.sqlite").rows() if r.is_commit]
    checkpoints = {"checkpoint-3": run / "checkpoint-3"}
    db = fsdp_runs / "mlflow.db"
    run_id = assert_checkpoints_in_mlflow(
        db, None, "rotated", "FSDP-9", checkpoints, tmp_path, parent=commits[1].manifest_sha256
    )
    from mlflow.tracking import MlflowClient

    tags = MlflowClient(tracking_uri=f"sqlite:///{db}").get_run(run_id).data.tags
    # The checkpoints the rotation deleted since were recorded at their save.
    for row in commits:
        assert tags[f"checkpoint/{row.checkpoint}/manifest_sha256"] == row.manifest_sha256
    assert read_manifest(run / "checkpoint-3")[0]["run_tags"] == {"ticket": "FSDP-9"}


# ---------------------------------------------------------------------- refusals, no launch
def _args(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **kw: object) -> TrainingArguments:
    monkeypatch.setenv("ACCELERATE_USE_FSDP", os.environ.get("ACCELERATE_USE_FSDP", "false"))
    return TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **kw)


SHARDED = {"fsdp": True, "fsdp_config": {"fsdp_version": 2, "state_dict_type": "SHARDED_STATE_DICT"}}


def test_arguments_that_save_no_dcp_folders_are_refused_before_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ConfigurationError, match="'full' \\(default\\) or 'sizes'"):
        LineageCallback(verify="none")
    begin = LineageCallback().on_train_begin
    with pytest.raises(ConfigurationError, match=r"FSDP is not enabled.*ShardlineTrainer"):
        begin(_args(tmp_path, monkeypatch), TrainerState(), TrainerControl())
    full = _args(tmp_path, monkeypatch, fsdp=True, fsdp_config={"fsdp_version": 2})
    with pytest.raises(ConfigurationError, match=r"saves FULL_STATE_DICT.*'state_dict_type': 'SHARDED_STATE_DICT'"):
        begin(full, TrainerState(), TrainerControl())
    begin(_args(tmp_path, monkeypatch, **SHARDED), TrainerState(), TrainerControl())  # accepted


def test_resume_from_a_checkpoint_not_under_lineage_and_fresh_start_over_adopted_ones_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = _args(tmp_path, monkeypatch, **SHARDED)
    folder = tmp_path / "checkpoint-3"
    (folder / "pytorch_model_fsdp_0").mkdir(parents=True)
    (folder / "trainer_state.json").write_text("{}")
    callback = LineageCallback()
    with pytest.raises(
        CheckpointNotFoundError, match=r"not under lineage.*shardline adopt .*checkpoint-3 --subfolders"
    ):
        callback.on_train_begin(args, TrainerState(global_step=3), TrainerControl())
    (folder / "manifest.json").write_text("{}")  # stands for an adopted checkpoint-N
    with pytest.raises(CheckpointExistsError, match=r"holds checkpoint-3 under lineage.*resume_from_checkpoint=True"):
        callback.on_train_begin(args, TrainerState(), TrainerControl())
