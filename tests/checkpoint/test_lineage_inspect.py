"""The hash-chained ledger and ``shardline lineage``; ``shardline inspect``."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
from pathlib import Path

import pytest

from shardline import cli
from shardline.checkpoint import Ledger
from shardline.checkpoint.integrity.manifest import read_manifest
from shardline.errors import LineageError


def test_lineage_prints_and_verifies(saved_run: Path, capsys) -> None:
    assert cli.main(["lineage", str(saved_run)]) == 0
    out = capsys.readouterr().out
    assert "2 committed checkpoint(s)" in out
    assert "Chain verified" in out
    assert read_manifest(saved_run / "step-4")[1][:12] in out
    assert cli.main(["lineage", "--json", str(saved_run.parent)]) == 0  # RUN_DIR/checkpoints/lineage.sqlite
    report = json.loads(capsys.readouterr().out)
    assert report["ok"]
    assert [r["step"] for r in report["rows"]] == [2, 4]
    assert report["rows"][1]["prev_row_sha256"] == report["rows"][0]["row_sha256"]


def test_ledger_is_append_only_and_tamper_evident(saved_run: Path, tmp_path: Path, capsys) -> None:
    ledger_path = tmp_path / "lineage.sqlite"
    shutil.copy(saved_run / "lineage.sqlite", ledger_path)
    conn = sqlite3.connect(ledger_path)
    with pytest.raises(sqlite3.DatabaseError, match="append-only"):
        conn.execute("UPDATE checkpoints SET step = 5 WHERE seq = 2")
    conn.execute("DROP TRIGGER checkpoints_no_update")  # someone bypasses the guard...
    conn.execute("UPDATE checkpoints SET step = 5 WHERE seq = 1")
    conn.commit()
    conn.close()
    report = Ledger(ledger_path).verify(check_checkpoints=False)  # ...and the chain shows it
    assert not report.ok
    assert any("row 1" in p and "edited" in p for p in report.problems)
    assert cli.main(["lineage", "--no-check-checkpoints", str(ledger_path)]) == 1
    assert "BROKEN" in capsys.readouterr().err


def test_ledger_detects_swapped_checkpoint(saved_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    shutil.rmtree(run / "step-4")
    shutil.copytree(saved_run / "step-2", run / "step-4")  # a different (valid) checkpoint under the old name
    report = Ledger(run / "lineage.sqlite").verify()
    assert not report.ok
    assert any("step-4" in p and "manifest hash" in p for p in report.problems)


def test_missing_ledger_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(LineageError, match="no lineage ledger"):
        Ledger(tmp_path / "nothing.sqlite").rows()


def _append_killed_inside_sqlite(ledger: str) -> None:
    """A first append killed (``os._exit``) after SQLite has created a database file, before its table exists."""
    real_connect = sqlite3.connect

    def connect_then_die(path, *args, **kwargs):
        real_connect(path, *args, **kwargs).close()  # the file exists now, empty, as after open(O_CREAT)
        os._exit(9)

    sqlite3.connect = connect_then_die
    Ledger(ledger).append(
        step=1, tag=None, checkpoint="step-1", manifest_sha256="a" * 64, parent_manifest_sha256=None, world_size=1
    )


def test_a_ledger_appears_whole_when_its_creation_is_killed_and_a_foreign_database_is_refused(tmp_path: Path) -> None:
    """kill -9 while SQLite creates the ledger's file: no half-made ledger at its name; the next save creates it."""
    import torch

    import shardline.checkpoint as ckpt
    from tests.checkpoint.crash_scenarios import fork_and_wait

    directory = tmp_path / "checkpoints"
    directory.mkdir()
    ledger = directory / "lineage.sqlite"
    code = fork_and_wait(_append_killed_inside_sqlite, (str(ledger),), name="ledger creation", point=None, hit=1)
    assert code == 9
    assert not ledger.exists(), "a killed creation must not leave a database without its table at the ledger's name"
    [leftover] = directory.glob(".lineage.sqlite.creating-*")
    model = torch.nn.Linear(4, 4)
    with ckpt.CheckpointManager(directory) as manager:
        manager.save(ckpt.SaveRequest(step=1, model=model))
    assert [row.step for row in Ledger(ledger).rows()] == [1]
    assert Ledger(ledger).verify().ok
    assert not leftover.exists(), "the next creation removes what the killed one left"
    # An empty database at the ledger's name (left by earlier versions' killed creations) still reads as empty.
    legacy = tmp_path / "legacy.sqlite"
    sqlite3.connect(legacy).close()
    assert Ledger(legacy).rows() == []
    foreign = tmp_path / "other.sqlite"
    with sqlite3.connect(foreign) as conn:
        conn.execute("CREATE TABLE notes (x TEXT)")
    with pytest.raises(LineageError, match="has no checkpoints table"):
        Ledger(foreign).rows()


def test_inspect(saved_run: Path, capsys) -> None:
    step = saved_run / "step-4"
    assert cli.main(["inspect", str(step)]) == 0
    text = capsys.readouterr().out
    assert "Checkpoint at training step 4 (a regular save) consists of 2 shard files totaling" in text
    assert "the manifest hash" in text.lower()
    assert read_manifest(step)[1] in text
    assert "continues from the checkpoint" in text
    assert cli.main(["inspect", "--json", str(step)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["step"] == 4
    assert summary["shard_files"] == 2
    assert summary["world_size"] == 2
    assert summary["total_bytes"] == sum(
        f.stat().st_size for f in step.iterdir() if f.suffix == ".distcp" or f.name == ".metadata"
    )
