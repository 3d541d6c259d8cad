"""Retention (``keep_last_n``): old checkpoints go only after a newer one commits, each leaving a tombstone row,
and the chain still verifies -- with shardline and by hand."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import shardline.checkpoint as ckpt
from shardline import cli
from shardline.checkpoint.provenance.retention import RetentionPolicy
from shardline.errors import ConfigurationError

DOCS = Path(__file__).resolve().parents[2] / "docs" / "verification.md"


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _train(model, opt) -> None:
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    opt.zero_grad()


def _run(directory: Path, steps: list[int], *, keep: int, tag_at: int | None = None) -> ckpt.CheckpointManager:
    model, opt = _model()
    manager = ckpt.CheckpointManager(directory, keep_last_n=keep)
    for step in steps:
        _train(model, opt)
        tag = "on_exception" if step == tag_at else None
        manager.save(ckpt.SaveRequest(step=step, model=model, optimizer=opt, config={"lr": 0.1}, tag=tag))
    return manager


def _dirs(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.is_dir())


def _documented(marker: str) -> str:
    text = DOCS.read_text()
    return re.search(rf"<!-- {marker} -->\n```bash\n(.*?)```", text, re.S).group(1)


def test_keep_last_n_deletes_after_commit_and_tombstones_keep_the_chain(tmp_path: Path, capsys) -> None:
    directory = tmp_path / "checkpoints"
    _run(directory, [1, 2, 3, 4, 5], keep=2, tag_at=3)
    # the tagged checkpoint is not counted nor deleted; of the regular ones the newest two stay
    assert _dirs(directory) == ["step-3-on_exception", "step-4", "step-5"]
    ledger = ckpt.Ledger(directory / "lineage.sqlite")
    rows = ledger.rows()
    tombs = [r for r in rows if r.event == "tombstone"]
    assert [r.checkpoint for r in tombs] == ["step-1", "step-2"]
    commits = {r.checkpoint: r for r in rows if r.is_commit}
    for tomb in tombs:
        commit = commits[tomb.checkpoint]
        assert tomb.seq > commit.seq
        assert tomb.manifest_sha256 == commit.manifest_sha256
        detail = json.loads(tomb.detail)
        assert detail["keep_last_n"] == 2
        assert detail["files"] == 3
        # the statement copy in the tombstone is byte for byte the one the commit row chained
        copy = json.dumps(detail["provenance"], sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
        assert hashlib.sha256(copy).hexdigest() == json.loads(commit.detail)["provenance"]["sha256"]
    # step-1 went when the third regular checkpoint (step-4) committed
    assert json.loads(tombs[0].detail)["newer"] == "step-4"
    report = ckpt.audit(ledger)
    assert report.ok, report.problems
    assert sum("deleted on purpose" in n for n in report.notes) == 2
    assert cli.main(["lineage", "--json", str(directory)]) == 0
    out = json.loads(capsys.readouterr().out)
    gone = next(r for r in out["rows"] if r["checkpoint"] == "step-1" and r["event"] == "commit")
    assert gone["provenance"]["source"] == "tombstone"
    assert gone["provenance"]["matches_ledger"] is True


def test_deletions_check_by_hand(tmp_path: Path) -> None:
    directory = tmp_path / "checkpoints"
    _run(directory, [1, 2, 3], keep=1)
    command = _documented("ledger-files-command")
    assert "shardline" not in command
    done = subprocess.run(["bash", "-c", command], cwd=directory, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines == [
        "step-1 deleted (tombstone row 3)",
        "step-2 deleted (tombstone row 5)",
        "step-3 OK",
    ], done.stdout
    shutil.rmtree(directory / "step-3")  # now one is gone without a record
    done = subprocess.run(["bash", "-c", command], cwd=directory, capture_output=True, text=True, check=False)
    assert "step-3 MISSING" in done.stdout


def test_deleted_by_hand_is_a_problem_until_recorded(tmp_path: Path, capsys) -> None:
    directory = tmp_path / "checkpoints"
    _run(directory, [1, 2], keep=0)
    shutil.rmtree(directory / "step-1")
    report = ckpt.audit(ckpt.Ledger(directory / "lineage.sqlite"))
    assert not report.ok
    assert "step-1 is gone from disk and no tombstone row records its deletion" in report.problems[0]
    assert cli.main(["lineage", str(directory)]) == 1
    assert cli.main(["lineage", str(directory), "--record-deletions"]) == 0
    assert "Recorded 1 deletion(s)" in capsys.readouterr().err
    rows = ckpt.Ledger(directory / "lineage.sqlite").rows()
    assert rows[-1].event == "tombstone"
    assert "outside shardline" in json.loads(rows[-1].detail)["reason"]


def test_an_interrupted_deletion_is_finished_without_a_second_row(tmp_path: Path, monkeypatch) -> None:
    from shardline.checkpoint.provenance import retention

    directory = tmp_path / "checkpoints"
    model, _opt = _model()
    manager = ckpt.CheckpointManager(directory, keep_last_n=1)
    manager.save(ckpt.SaveRequest(step=1, model=model))
    real = retention._remove
    monkeypatch.setattr(retention, "_remove", lambda c: (_ for _ in ()).throw(OSError("crash before the rename")))
    manager.save(ckpt.SaveRequest(step=2, model=model))  # the tombstone is written, the deletion fails
    assert _dirs(directory) == ["step-1", "step-2"]
    report = ckpt.audit(ckpt.Ledger(directory / "lineage.sqlite"))
    assert report.ok
    assert any("interrupted deletion" in n for n in report.notes)
    monkeypatch.setattr(retention, "_remove", real)
    (directory / ".step-0.deleting-0123456789ab").mkdir()  # a crash after a rename: the next manager clears it
    manager = ckpt.CheckpointManager(directory, keep_last_n=1)
    manager.save(ckpt.SaveRequest(step=3, model=model))
    assert _dirs(directory) == ["step-3"]
    rows = ckpt.Ledger(directory / "lineage.sqlite").rows()
    assert [r.checkpoint for r in rows if r.event == "tombstone"] == ["step-1", "step-2"]  # one row each
    assert ckpt.audit(ckpt.Ledger(directory / "lineage.sqlite")).ok


def test_signature_goes_with_its_checkpoint(tmp_path: Path) -> None:
    directory = tmp_path / "checkpoints"
    model, _opt = _model()
    manager = ckpt.CheckpointManager(directory, keep_last_n=1)
    manager.save(ckpt.SaveRequest(step=1, model=model))
    (directory / "step-1.sig").write_text("{}")
    manager.save(ckpt.SaveRequest(step=2, model=model))
    assert not (directory / "step-1.sig").exists()
    tomb = ckpt.Ledger(directory / "lineage.sqlite").rows()[-1]
    detail = json.loads(tomb.detail)
    assert detail["signature_sha256"] == hashlib.sha256(b"{}").hexdigest()
    assert detail["provenance"]["subject"]  # the statement itself is kept


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_keep_last_n_must_be_a_count(bad) -> None:
    with pytest.raises(ConfigurationError, match="keep_last_n"):
        RetentionPolicy(keep_last_n=bad)


def test_training_config_rejects_a_negative_count(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "shardline.cli", "train", "checkpoint.keep_last_n=-2", f"trainer.run_dir={tmp_path}/r"],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.returncode == 2
    assert "checkpoint.keep_last_n must be a non-negative integer" in done.stderr


def test_a_reused_name_gets_one_tombstone_per_commit(tmp_path: Path) -> None:
    """A name saved twice (a Trainer that went back to an earlier checkpoint): each commit is buried once."""
    from shardline.checkpoint.provenance.retention import record_deletions

    ledger = ckpt.Ledger(tmp_path / "lineage.sqlite")
    first, second = "a" * 64, "b" * 64
    common = {"step": 4, "tag": None, "checkpoint": "checkpoint-4/shardline", "world_size": 1}
    ledger.append(**common, manifest_sha256=first, parent_manifest_sha256=None)
    ledger.append(**common, manifest_sha256=first, parent_manifest_sha256=None, event="tombstone",
                  detail={"checkpoint": common["checkpoint"], "reason": "went back", "moved_to": "abandoned/x"})  # fmt: skip
    ledger.append(**common, manifest_sha256=second, parent_manifest_sha256=None)
    # The second checkpoint-4 is deleted by hand (its folder is not on disk): recorded once, the first never again.
    assert [(r.event, r.manifest_sha256) for r in record_deletions(ledger)] == [("tombstone", second)]
    assert record_deletions(ledger) == [], "every commit of the name already has its own tombstone"
    report = ledger.verify()
    assert report.ok, report.problems
    assert any("was retired on purpose and moved to abandoned/x" in n for n in report.notes), report.notes
