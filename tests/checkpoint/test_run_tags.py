"""Run tags (ticket, owner...) in each checkpoint's manifest and provenance statement, given to the manager or the
request; bad tags refused before anything is written; the tracker record read from a manifest."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
import torch

from shardline.checkpoint import CheckpointManager, SaveRequest, verify_checkpoint
from shardline.checkpoint.provenance.tracker_record import tracker_record
from shardline.errors import ConfigurationError


def _read(path: Path) -> dict:
    return json.loads(path.read_bytes())


def test_manager_and_request_tags_are_recorded_in_manifest_and_statement(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 3)
    manager = CheckpointManager(tmp_path / "ckpt", tags={"ticket": "ABC-1", "owner": "ana"})
    manager.save(SaveRequest(model=model, step=1, run_tags={"owner": "bob", "dataset_licence": "cc-by-4.0"}))
    manager.save(SaveRequest(model=model, step=2))
    first, second = tmp_path / "ckpt" / "step-1", tmp_path / "ckpt" / "step-2"
    want = {"dataset_licence": "cc-by-4.0", "owner": "bob", "ticket": "ABC-1"}  # the request wins per key
    assert _read(first / "manifest.json")["run_tags"] == want
    assert _read(first / "provenance.intoto.json")["predicate"]["run_tags"] == want
    assert _read(second / "manifest.json")["run_tags"] == {"owner": "ana", "ticket": "ABC-1"}
    for path in (first, second):
        report = verify_checkpoint(path)
        assert report.ok, report.problems

    record = tracker_record(second)
    raw = (second / "manifest.json").read_bytes()
    assert record.manifest_json == raw
    assert record.manifest_sha256 == hashlib.sha256(raw).hexdigest()
    assert record.parent_manifest_sha256 == hashlib.sha256((first / "manifest.json").read_bytes()).hexdigest()
    assert record.run_tags == {"owner": "ana", "ticket": "ABC-1"}
    # The statement names the manifest (its one subject), so the manifest's file table -- and the record's --
    # lists every other file; the statement is pinned by SHA256SUMS and the ledger row.
    statement = json.loads((second / "provenance.intoto.json").read_bytes())
    assert statement["subject"][0]["digest"]["sha256"] == record.manifest_sha256
    derived = ("manifest.json", "manifest.sha256", "SHA256SUMS", "provenance.intoto.json")
    on_disk = sorted(p.name for p in second.iterdir() if p.name not in derived)
    assert [f[1] for f in record.files] == on_disk
    for rank, name, size, sha in record.files:
        assert (rank, size, sha) == (
            0,
            (second / name).stat().st_size,
            hashlib.sha256((second / name).read_bytes()).hexdigest(),
        )
    assert record.flat()["checkpoint/step-2/world_size"] == "1"
    assert record.flat()["checkpoint/step-2/state_dict_kind"] == "sharded"


def test_a_save_without_tags_writes_the_manifest_it_always_wrote(tmp_path: Path) -> None:
    CheckpointManager(tmp_path / "ckpt").save(SaveRequest(model=torch.nn.Linear(2, 2), step=1))
    assert "run_tags" not in _read(tmp_path / "ckpt" / "step-1" / "manifest.json")
    assert "run_tags" not in _read(tmp_path / "ckpt" / "step-1" / "provenance.intoto.json")["predicate"]
    assert tracker_record(tmp_path / "ckpt" / "step-1").run_tags == {}


@pytest.mark.parametrize(
    ("tags", "message"),
    [
        ({"bad key": "x"}, "key 'bad key' is not a tag name"),
        ({"shardline.run": "x"}, "key 'shardline.run' is reserved"),
        ({"ticket": 5}, "tags.ticket=5 is not a string (int); tag values are strings"),
        ({"ticket": "a\nb"}, "a tag value is 1-256 printable characters on one line"),
        ({"ticket": "x" * 257}, "(got 257 characters)"),
        ({f"k{i}": "v" for i in range(65)}, "has 65 tags; at most 64 are allowed"),
        (["ticket"], "must be a mapping of KEY: VALUE strings, got list"),
    ],
)
def test_bad_tags_are_refused_before_anything_is_written(tmp_path: Path, tags: object, message: str) -> None:
    with pytest.raises(ConfigurationError, match=r"^tags") as raised:
        CheckpointManager(tmp_path / "ckpt", tags=tags)  # type: ignore[arg-type]
    assert message in str(raised.value)
    assert not (tmp_path / "ckpt").exists()
    with pytest.raises(ConfigurationError) as raised:
        SaveRequest(model=torch.nn.Linear(2, 2), step=1, run_tags=tags)  # type: ignore[arg-type]
    assert message in str(raised.value)


def test_tracking_tags_on_the_command_line_are_typed_and_checked() -> None:
    from shardline.train.config import compose_config, to_train_config

    cfg = to_train_config(compose_config(["tracking.tags.ticket=ABC-1", "tracking.tags.owner=ana"]))
    assert cfg.tracking.tags == {"ticket": "ABC-1", "owner": "ana"}
    with pytest.raises(ConfigurationError, match=r"tracking\.tags\.ticket='xxx.*\(got 300 characters\)"):
        to_train_config(compose_config(["tracking.tags.ticket=" + "x" * 300]))
    with pytest.raises(ConfigurationError, match=re.escape("Did you mean 'tracking.tags'")):
        compose_config(["tracking.tag.ticket=ABC-1"])
