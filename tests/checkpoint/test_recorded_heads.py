"""Retention and resume selection take each recorded checkpoint from its commit row once its manifest's bytes hash
to that row's hash, and a tombstone's counts from the deleted one's row: no manifest is parsed at a save. What is
served equals what parsing gives; anything that does not match (no row, an altered manifest, an old row) is read
whole as before (provenance/recorded_heads.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import shardline.checkpoint as ckpt
from shardline.checkpoint.format.canonical import sha256_hex
from shardline.checkpoint.integrity import manifest as manifest_module
from shardline.checkpoint.lifecycle.resume import find_candidates
from shardline.checkpoint.provenance import directory as directory_module
from shardline.checkpoint.provenance import retention as retention_module
from shardline.checkpoint.provenance.directory import scan
from shardline.checkpoint.provenance.ledger import TOMBSTONE
from shardline.checkpoint.provenance.recorded_heads import _created_unix_ns, from_ledger, held_recorded
from shardline.checkpoint.storage.stores import locate


def _manager(directory: Path, keep: int) -> tuple[ckpt.CheckpointManager, torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    return ckpt.CheckpointManager(directory, keep_last_n=keep), model, torch.optim.SGD(model.parameters(), lr=0.1)


def _save(m: ckpt.CheckpointManager, model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, **kw) -> None:
    m.save(ckpt.SaveRequest(step=step, model=model, optimizer=opt, config={"lr": 0.1}, **kw))


def _tombstones(m: ckpt.CheckpointManager) -> list[dict]:
    return [json.loads(r.detail or "{}") for r in m.ledger.rows() if r.event == TOMBSTONE]


def test_retention_and_resume_parse_no_manifest_and_serve_what_parsing_gives(tmp_path: Path, monkeypatch) -> None:
    directory = tmp_path / "checkpoints"
    m, model, opt = _manager(directory, keep=2)
    _save(m, model, opt, 1)
    _save(m, model, opt, 2, tag="on_exception")
    _save(m, model, opt, 3)
    rows = m.ledger.rows()
    full = scan(locate(directory))[0]
    quick = scan(locate(directory), known=from_ledger(rows, m.ledger.name_of))[0]
    assert quick == full  # step, tag, hashes, world size, the manifest's own creation time
    before = retention_module._what_it_held(full[0])  # parsed: step-1 as a tombstone would record it
    assert held_recorded(rows[0]) == {"files": before["files"], "bytes": before["bytes"]}

    parsed: list[object] = []

    def counting(path):
        parsed.append(path)
        return manifest_module.read_manifest(path)

    for module in (directory_module, retention_module):
        monkeypatch.setattr(module, "read_manifest", counting)
    _save(m, model, opt, 4)  # retention deletes step-1
    found = find_candidates("auto", directory=locate(directory), ledger=m.ledger)
    assert parsed == []
    assert [Path(c.location).name for c in found.committed] == ["step-4", "step-3", "step-2-on_exception"]
    (tomb,) = _tombstones(m)
    assert {k: tomb[k] for k in before} == before  # the same counts, statement and hash as parsing recorded


def test_what_does_not_match_its_row_is_read_whole(tmp_path: Path, monkeypatch) -> None:
    directory = tmp_path / "checkpoints"
    m, model, opt = _manager(directory, keep=0)
    for step in (1, 2, 3):
        _save(m, model, opt, step)
    # step-2: a manifest edited by hand and its manifest.sha256 rewritten to match: the row's hash is not it
    manifest = directory / "step-2" / "manifest.json"
    raw = manifest.read_bytes().replace(b'"step":2', b'"step": 2')
    manifest.write_bytes(raw)
    (directory / "step-2" / "manifest.sha256").write_text(f"{sha256_hex(raw)}  manifest.json\n")
    # step-3: altered without its hash file
    (directory / "step-3" / "manifest.json").write_bytes(b" " + (directory / "step-3" / "manifest.json").read_bytes())
    rows = m.ledger.rows()
    quick = scan(locate(directory), known=from_ledger(rows, m.ledger.name_of))
    assert quick == scan(locate(directory))  # both damaged, as parsing says
    assert [c.path.name for c in quick[0]] == ["step-1"]
    assert [d.path.name for d in quick[1]] == ["step-2", "step-3"]


def test_a_row_without_counts_is_served_by_parsing(tmp_path: Path, monkeypatch) -> None:
    """Ledgers written before ``detail.held``: the tombstone's counts come from the manifest, as before."""
    directory = tmp_path / "checkpoints"
    monkeypatch.setattr("shardline.checkpoint.provenance.records._held", lambda checkpoint: None)
    m, model, opt = _manager(directory, keep=1)
    _save(m, model, opt, 1)
    held = retention_module._what_it_held(scan(locate(directory))[0][0])
    assert held_recorded(m.ledger.rows()[0]) is None
    _save(m, model, opt, 2)
    (tomb,) = _tombstones(m)
    assert (tomb["files"], tomb["bytes"]) == (held["files"], held["bytes"])


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (b'{"a":{"x":[1,"}"]},"created_unix_ns":17,"files":[]}', 17),
        (b'{"a":1,"files":[],"step":1}', 0),  # none: scan reads 0
        (b'{"created_unix_ns":"17","files":[]}', None),  # not an int: read whole
        (b'{"a":"' + b"x" * 70000 + b'","created_unix_ns":1}', None),  # past the head window: read whole
        (b"[]", None),
    ],
)
def test_the_creation_time_comes_from_the_keys_before_the_file_list(text: bytes, expected: int | None) -> None:
    assert _created_unix_ns(text) == expected


def test_a_new_chain_takes_each_checkpoint_from_its_intact_row_and_reads_an_edited_ones_whole(
    tmp_path: Path, monkeypatch
) -> None:
    import sqlite3

    from shardline.checkpoint.provenance.lineage import start_new_chain

    directory = tmp_path / "checkpoints"
    m, model, opt = _manager(directory, keep=0)
    for step in (1, 2, 3):
        _save(m, model, opt, step)
    full = scan(locate(directory))[0]
    conn = sqlite3.connect(m.ledger.path)
    conn.execute("DROP TRIGGER checkpoints_no_update")
    conn.execute("UPDATE checkpoints SET world_size = 99 WHERE step = 2")  # edited: its row hash no longer matches
    conn.commit()
    conn.close()
    report = m.ledger.verify()
    assert not report.ok

    parsed: list[str] = []

    def counting(path):
        parsed.append(path.name)
        return manifest_module.read_manifest(path)

    monkeypatch.setattr(directory_module, "read_manifest", counting)
    _, rows = start_new_chain(m.ledger, problems=list(report.problems))
    assert parsed == ["step-2"]  # the edited row's checkpoint is read whole; the others are served by their rows
    recorded = [(r.checkpoint, r.step, r.manifest_sha256, r.parent_manifest_sha256, r.world_size) for r in rows[1:]]
    assert recorded == [
        (m.ledger.name_of(c.path), c.step, c.manifest_hash, c.parent_manifest_hash, c.world_size) for c in full
    ]
    assert m.ledger.verify().ok
