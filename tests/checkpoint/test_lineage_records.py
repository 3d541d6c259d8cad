"""One writer of lineage rows: each kind of row has one operation (provenance/records.py), the rows it writes have
the shape they always had, nothing else in src/ appends to a ledger, and rank 0's decisions go through one helper
(an error on rank 0 reaches every rank with its class)."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import pytest

import shardline
import shardline.checkpoint as ckpt
from shardline.checkpoint.format.canonical import canonical_json
from shardline.checkpoint.provenance import records
from shardline.checkpoint.provenance.directory import CommittedCheckpoint
from shardline.checkpoint.provenance.ledger import Ledger, LedgerRow

SRC = Path(shardline.__file__).parent
OWNERS = {"checkpoint/provenance/ledger.py", "checkpoint/provenance/records.py"}
A, B, C = "a" * 64, "b" * 64, "c" * 64


def _row(row: LedgerRow) -> dict[str, Any]:
    """A row's written fields (its sequence, time and hashes aside)."""
    out = row.to_json()
    for key in ("seq", "committed_at", "prev_row_sha256", "row_sha256"):
        del out[key]
    return out


def _expected(detail: dict[str, Any] | None, **fields: Any) -> dict[str, Any]:
    """The row as the writers before the records module wrote it: ``detail`` as its canonical JSON text."""
    return {**fields, "detail": canonical_json(detail).decode() if detail is not None else None}


def test_each_kind_of_row_keeps_its_shape(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "lineage.sqlite")
    step3 = tmp_path / "step-3"
    saved = ckpt.CheckpointInfo(
        path=step3, step=3, manifest_hash=A, tag=None, kind="sharded", world_size=2, files=4, total_bytes=9,
        parent_manifest_hash=B, provenance_sha256=C,
    )  # fmt: skip
    found = CommittedCheckpoint(
        path=tmp_path / "step-1", step=1, tag="on_exception", manifest_hash=B, created_unix_ns=0,
        parent_manifest_hash=None, world_size=4,
    )  # fmt: skip
    commit = {"tag": None, "parent_manifest_sha256": B, "world_size": 2, "recovered": False, "event": "commit"}

    row = records.record_commit(ledger, saved, recovered=False)
    link = {"provenance": {"file": "provenance.intoto.json", "sha256": C}}
    held = {"held": {"files": 4, "bytes": 9}}  # what a tombstone of it records, without parsing its manifest
    assert _row(row) == _expected({**link, **held}, step=3, checkpoint="step-3", manifest_sha256=A, **commit)
    row = records.record_commit(ledger, saved, recovered=False, statement=False)  # Lightning's and HF's rows
    assert _row(row) == _expected(None, step=3, checkpoint="step-3", manifest_sha256=A, **commit)
    row = records.record_commit(ledger, found, recovered=True)  # no statement on disk: no link
    assert _row(row) == _expected(
        None, step=1, tag="on_exception", checkpoint="step-1", manifest_sha256=B, parent_manifest_sha256=None,
        world_size=4, recovered=True, event="commit",
    )  # fmt: skip

    event = {"tag": None, "parent_manifest_sha256": None, "recovered": False}
    aside = tmp_path / "step-3.damaged-20250101T000000Z"
    row = records.record_quarantine(ledger, checkpoint=step3, moved_to=aside, recorded=A, reason="bad shard")
    assert _row(row) == _expected(
        {"checkpoint": "step-3", "moved_to": aside.name, "reason": "bad shard"},
        step=3, checkpoint=aside.name, manifest_sha256=A, world_size=0, event="quarantine", **event,
    )  # fmt: skip
    row = records.record_quarantine(ledger, checkpoint=tmp_path / "odd", moved_to=aside, recorded=None, reason="r")
    assert (row.step, row.manifest_sha256) == (0, "")

    row = records.record_resume(ledger, checkpoint=step3, step=3, manifest_hash=A, world_size=2, verify="manifest")
    assert _row(row) == _expected(
        {"checkpoint": "step-3", "verify": "manifest"},
        step=3, checkpoint="step-3", manifest_sha256=A, world_size=2, event="resume", **event,
    )  # fmt: skip
    restart = {"checkpoint": step3, "step": 5, "manifest_hash": None, "world_size": 2, "world_size_before": 4}
    row = records.record_restart(ledger, **restart, world_size_after=2, cause="node_lost")
    assert _row(row) == _expected(
        {"checkpoint": "step-3", "world_size_before": 4, "world_size_after": 2, "cause": "node_lost"},
        step=5, checkpoint="step-3", manifest_sha256="", world_size=2, event="restart", **event,
    )  # fmt: skip
    row = records.record_restart(ledger, **restart, world_size_after=2, cause="node_lost", elastic_restart=2)
    assert json.loads(row.detail or "")["elastic_restart"] == 2

    tomb = {
        "step": 1,
        "tag": "on_exception",
        "checkpoint": "step-1",
        "manifest_sha256": B,
        "parent_manifest_sha256": None,
    }
    tomb |= {"world_size": 4, "recovered": False, "event": "tombstone"}
    held = {"files": 3, "bytes": 10, "provenance_sha256": C}
    row = records.record_tombstone(  # retention
        ledger, of=found, checkpoint="step-1", reason="retention: ...", keep_last_n=2, newer="step-3", held=held
    )
    detail = {"checkpoint": "step-1", "reason": "retention: ...", "keep_last_n": 2, "newer": "step-3", **held}
    assert _row(row) == _expected(detail, **tomb)
    row = records.record_tombstone(ledger, of=found, checkpoint="step-1", reason="pruned", held=held)  # retire()
    assert _row(row) == _expected({"checkpoint": "step-1", "reason": "pruned", **held}, **tomb)
    first = ledger.rows()[2]  # the commit row of step-1
    row = records.record_tombstone(ledger, of=first, checkpoint="step-1", reason="by hand", commit_row=first.seq)
    assert _row(row) == _expected({"checkpoint": "step-1", "reason": "by hand", "commit_row": 3}, **tomb)
    row = records.record_tombstone(  # a Trainer's checkpoint moved aside
        ledger, of=first, checkpoint="step-1", reason="abandoned; moved aside to x", moved_to="x", commit_row=3
    )
    detail = {"checkpoint": "step-1", "reason": "abandoned; moved aside to x", "moved_to": "x", "commit_row": 3}
    assert _row(row) == _expected(detail, **tomb)
    assert ledger.verify(check_checkpoints=False).ok


def _ledger_appends(path: Path) -> list[str]:
    """``<ledger>.append(...)`` calls in a module: on a name or attribute that says ledger, or on ``Ledger(...)``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "append"):
            continue
        target = node.func.value
        if isinstance(target, ast.Call):
            target = target.func
        name = target.id if isinstance(target, ast.Name) else target.attr if isinstance(target, ast.Attribute) else ""
        if "ledger" in name.lower():
            found.append(f"{path.relative_to(SRC)}:{node.lineno}")
    return found


def test_rows_are_appended_only_by_the_records_module() -> None:
    modules = [p for p in SRC.rglob("*.py") if p.relative_to(SRC).as_posix() not in OWNERS]
    assert len(modules) > 100  # the walk saw the package
    assert [hit for path in modules for hit in _ledger_appends(path)] == []
    assert _ledger_appends(SRC / "checkpoint/provenance/records.py")  # the scan finds the owner's own appends


def test_rank0_decisions_have_one_helper() -> None:
    """Only coordination/coord.py sends rank 0's answers; what else broadcasts pickles is named here with why."""
    allowed = {
        "engine/state_dict.py",  # below checkpoint/ in the layers: cannot use coord
        "lightning/strategy.py",  # Strategy.broadcast: Lightning's API, any picklable object
    }
    hits = sorted(
        p.relative_to(SRC).as_posix()
        for p in SRC.rglob("*.py")
        if "broadcast_object_list" in p.read_text() or "def _on_rank0" in p.read_text()
    )
    assert [h for h in hits if h not in allowed] == []


def test_hf_an_error_on_rank0_reaches_every_rank_with_its_class(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from shardline.testing import run_distributed
    from tests.checkpoint import ranks

    results = run_distributed(ranks.hf_append_fails_on_rank0, 2, args=(str(tmp_path),), timeout=60)
    assert results[0] == results[1], results  # rank 1 is not left waiting
    kind, message = results[0]
    assert kind == "LineageError", results
    assert message.startswith("the lineage ledger ")
    assert message.endswith("is unreadable or damaged: file is not a database")
