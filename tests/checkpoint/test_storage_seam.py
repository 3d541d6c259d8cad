"""The storage seam: one ``CheckpointStore`` protocol, answered the same way by the local and the object store.

Each operation of the protocol is run against both implementations (a local directory, and a
prefix on a real S3 server) and checked for the same outcome and the crash points the protocol
documents; the manager's behaviour that goes through the seam (a quarantine takes the
signature along) is checked on both. Outside ``checkpoint/storage/`` no module names a backend.
"""

from __future__ import annotations

import dataclasses
import re
import uuid
from pathlib import Path

import pytest

import shardline
import shardline.checkpoint as ckpt
from shardline.checkpoint.faults import crashpoints
from shardline.checkpoint.faults.observer import NO_OBSERVER
from shardline.checkpoint.lifecycle.resume import ResumeCandidates, find_candidates
from shardline.checkpoint.provenance.retention import signature_path_for
from shardline.checkpoint.storage.local import LocalStore
from shardline.checkpoint.storage.object_store import ObjectStore
from shardline.checkpoint.storage.protocol import COMMIT_RECORD, CommitRecord, Location
from shardline.checkpoint.storage.stores import locate, store_for
from shardline.errors import CheckpointExistsError
from tests.checkpoint import crash_scenarios as sc
from tests.checkpoint.conftest import S3_BUCKET

SRC = Path(shardline.__file__).parent
CHECKPOINT = SRC / "checkpoint"

# What each store passes through, in order, for one save (docs/checkpoint-protocol.md, "Crash points").
SAVE_POINTS = {
    "local": ["save.tmp_created", "save.manifest_written", "save.sums_written", "save.renamed", "save.committed"],
    "object_store": [
        "save.store_claimed",
        "save.store_uploaded",
        "save.sums_written",
        "save.committed",
        "save.store_claim_released",
    ],
}
MOVE_POINTS = {
    "local": ["quarantine.moved"],
    "object_store": ["quarantine.store_copied", "quarantine.store_manifest_deleted", "quarantine.store_removed"],
}
REMOVE_POINTS = {
    "local": ["retention.renamed", "retention.signature_removed", "retention.removed"],
    "object_store": ["retention.store_manifest_deleted", "retention.store_removed"],
}


@pytest.fixture(params=["local", "object_store"])
def directory(request: pytest.FixtureRequest, tmp_path: Path) -> Location:
    """An empty directory of checkpoints: a local one, or a fresh prefix on the test's S3 server."""
    if request.param == "local":
        return locate(tmp_path / "checkpoints")
    request.getfixturevalue("s3_env")
    return locate(f"s3://{S3_BUCKET}/{uuid.uuid4().hex[:12]}")


def _kind(directory: Location) -> str:
    return "local" if isinstance(store_for(directory), LocalStore) else "object_store"


def _save(directory: Location, name: str, payload: bytes) -> Location:
    """One save through the protocol alone: prepare, write a data file, commit; returns the checkpoint."""
    store = store_for(directory)
    if _kind(directory) == "local":
        Path(str(directory)).mkdir(parents=True, exist_ok=True)
    final = directory / name
    tmp_name, _ = store.prepare(final, run=lambda: "the seam test")
    in_progress = final.with_name(tmp_name)
    store.check_writable(in_progress, prepared_here=True)
    files = store.save_files(in_progress)
    data = str(files.join(files.root, "__0_0.distcp"))
    with files.open_write(data) as f:
        f.write(payload)
    files.written(data)
    committed: list[bool] = []
    store.commit(
        in_progress,
        final,
        records=[
            CommitRecord(COMMIT_RECORD, b'{"step":1}', written="save.manifest_written"),
            CommitRecord("SHA256SUMS", b"sums"),
        ],
        flush=[],
        observer=NO_OBSERVER,
        wait_synced=lambda: None,
        on_commit=lambda: committed.append(True),
    )
    store.end_save(in_progress)
    assert committed == [True]
    return final


def _traced(action) -> list[str]:
    crashpoints.trace()
    try:
        action()
        return crashpoints.traced()
    finally:
        crashpoints.disarm()


def test_no_module_outside_storage_names_a_backend() -> None:
    backend = re.compile(r"ObjectPath|is_url|in_object_store")
    naming = sorted(
        str(p.relative_to(SRC))
        for p in SRC.rglob("*.py")
        if "checkpoint/storage/" not in p.as_posix() and backend.search(p.read_text())
    )
    assert naming == []


def test_no_checkpoint_module_is_over_600_lines() -> None:
    long = {
        str(p.relative_to(CHECKPOINT)): n
        for p in CHECKPOINT.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 600
    }
    assert long == {}


def test_store_for_answers_from_text_alone() -> None:
    assert isinstance(store_for("s3://bucket/run"), ObjectStore)  # no client made: nothing to connect to
    assert isinstance(store_for("/tmp/run"), LocalStore)
    assert isinstance(store_for(Path("run")), LocalStore)


def test_a_save_commits_and_leaves_nothing_but_the_checkpoint(directory: Location) -> None:
    store = store_for(directory)
    final: list[Location] = []
    points = _traced(lambda: final.append(_save(directory, "step-1", b"payload")))
    assert points == SAVE_POINTS[_kind(directory)]
    step1 = final[0]
    assert store.names(directory) == {"step-1"}  # no in-progress directory, lock or claim left
    assert (step1 / "__0_0.distcp").read_bytes() == b"payload"
    assert (step1 / COMMIT_RECORD).read_bytes() == b'{"step":1}'
    assert store.still_there(step1)
    assert store.holder(step1) is None
    with pytest.raises(CheckpointExistsError, match="already exists"):
        store.prepare(step1)
    assert store.names(directory) == {"step-1"}  # the refused save reserved nothing


def test_a_failed_save_is_discarded_whole(directory: Location) -> None:
    store = store_for(directory)
    _save(directory, "step-1", b"one")
    final = directory / "step-2"
    in_progress = final.with_name(store.prepare(final)[0])
    files = store.save_files(in_progress)
    with files.open_write(str(files.join(files.root, "__0_0.distcp"))) as f:
        f.write(b"half")
    store.discard(in_progress)
    store.end_save(in_progress)
    assert store.names(directory) == {"step-1"}
    assert not store.still_there(final)


def test_latest_names_the_newest_either_way(directory: Location) -> None:
    store = store_for(directory)
    step1 = _save(directory, "step-1", b"one")
    store.write_latest(directory, step1)
    assert store.read_latest(directory, newest=lambda: step1) == step1


def test_move_aside_then_remove_through_the_store(directory: Location) -> None:
    store = store_for(directory)
    step1 = _save(directory, "step-1", b"one")
    store.put(signature_path_for(step1), b"signature")
    target = directory / "step-1.damaged-20250101T000000Z"
    assert _traced(lambda: store.move_aside(step1, target)) == MOVE_POINTS[_kind(directory)]
    store.move_file(signature_path_for(step1), signature_path_for(target))
    assert store.names(directory) == {target.name, f"{target.name}.sig"}
    assert (target / "__0_0.distcp").read_bytes() == b"one"
    assert store.finish_move(step1, target)  # nothing left to move
    points = _traced(lambda: store.remove(target, companions=[signature_path_for(target)]))
    assert points == REMOVE_POINTS[_kind(directory)]
    assert store.names(directory) == set()
    assert store.half_removed(directory) == []


def test_a_quarantine_takes_the_signature_along_on_either_store(directory: Location, tmp_path: Path) -> None:
    ledger = tmp_path / "lineage.sqlite"
    manager = ckpt.CheckpointManager(str(directory), ledger_path=ledger, files_per_rank=1)
    model, opt = sc._model()
    for step in (1, 2):
        sc._save(manager, model, opt, step)
    store = store_for(directory)
    step2 = manager.path_for(2)
    store.put(signature_path_for(step2), b"a signature of step-2")
    shard = step2 / f"{store.save_files(step2).data_prefix(0)}0.distcp"  # flat on disk, shards/0000/ in a bucket
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    store.put(shard, bytes(data))

    again = ckpt.CheckpointManager(str(directory), ledger_path=ledger, files_per_rank=1)
    state = again.load("auto", model=model, optimizer=opt)
    assert state is not None
    assert state["step"] == 1
    [moved] = again.moved_aside
    names = store.names(directory)
    assert moved.name.startswith("step-2.damaged-")
    assert f"{moved.name}.sig" in names
    assert "step-2.sig" not in names
    assert again.latest() == manager.path_for(1)


def test_resume_candidates_are_a_frozen_record(tmp_path: Path) -> None:
    manager = ckpt.CheckpointManager(tmp_path / "checkpoints")
    model, opt = sc._model()
    sc._save(manager, model, opt, 1)
    plan = find_candidates("auto", directory=manager.directory, ledger=manager.ledger)
    assert isinstance(plan, ResumeCandidates)
    assert [c.location for c in plan.committed] == [str(manager.path_for(1))]
    assert plan.committed[0].manifest_hash == manager.ledger.rows()[-1].manifest_sha256
    assert ResumeCandidates.from_json(plan.to_json()) == plan
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.committed = ()  # type: ignore[misc]
