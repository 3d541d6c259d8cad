"""One test per crash window and failure path of the save/commit/resume protocol (issue 20).

The crashes run in a child process (``crash_scenarios.child``, ``os._exit`` at a named crash
point); the failure paths are injected in-process by replacing one function.
"""

from __future__ import annotations

import datetime
import errno
import importlib
import json
import os
import sqlite3
import threading
import warnings
from pathlib import Path

import pytest
import torch

import shardline.checkpoint as ckpt
from shardline import cli
from shardline.checkpoint.faults.crashpoints import CRASH_EXIT_CODE
from shardline.checkpoint.faults.observer import SaveObserver, SavePhase
from shardline.checkpoint.integrity import reading
from shardline.checkpoint.integrity.manifest import read_manifest
from shardline.checkpoint.lifecycle import manager as manager_module
from shardline.checkpoint.provenance.lineage import audit
from shardline.checkpoint.provenance.retention import signature_path_for
from shardline.checkpoint.storage.fsutil import fsync_dir
from shardline.errors import CheckpointReadError, CheckpointWarning, IntegrityError, LineageError, PublishError
from tests.checkpoint import crash_scenarios as sc


def _crash(name: str, root: Path, point: str, hit: int = 1) -> None:
    code = sc.run_child(name, root, point, hit)
    assert code == CRASH_EXIT_CODE, f"the child did not crash at {point}: exit {code}"


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    return sc._model()


def _save(manager: ckpt.CheckpointManager, model, opt, step: int, **kw) -> ckpt.CheckpointInfo | None:
    sc._step(model, opt)
    return manager.save(ckpt.SaveRequest(step=step, model=model, optimizer=opt, state={"step": step}, **kw))


def _names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.is_dir())


# -- 1. a crash right after a new ledger's first row ---------------------------------------------------------


def test_a_crash_after_the_first_ledger_row_is_not_tampering(tmp_path: Path) -> None:
    sc.prepare("first_save", tmp_path)
    _crash("first_save", tmp_path, "ledger.row_committed")
    ledger = ckpt.Ledger(sc.ledger_path(tmp_path))
    assert [r.step for r in ledger.rows()] == [1]
    assert ledger.head_record() == (0, "0" * 64)  # the genesis head: behind, not missing
    report = audit(ledger)
    assert report.ok, report.problems
    m = sc.manager(tmp_path)  # opens: no --new-chain needed
    _save(m, *_model(), 2)
    rows = ledger.rows()
    assert [(r.step, r.event) for r in rows] == [(1, "commit"), (2, "commit")]
    assert ledger.head_record() == (2, rows[-1].row_sha256)


def test_a_missing_head_with_rows_is_still_a_problem(tmp_path: Path) -> None:
    m = sc.manager(tmp_path)
    _save(m, *_model(), 1)
    ledger = ckpt.Ledger(sc.ledger_path(tmp_path))
    ledger.head_path.unlink()  # not a crash window: nothing shardline does leaves rows without any head
    assert any("head record" in p for p in audit(ledger).problems)
    with pytest.raises(LineageError, match="head record"):
        sc.manager(tmp_path)


def test_a_crash_in_a_new_chain_leaves_the_old_ledger_or_the_whole_new_one(tmp_path: Path) -> None:
    sc.prepare("new_chain", tmp_path)
    _crash("new_chain", tmp_path, "ledger.row_committed")  # the chain_break row, in the ledger being built
    with pytest.raises(LineageError):  # still the old, broken ledger: the user runs --new-chain again
        sc.manager(tmp_path)
    assert cli.main(["lineage", str(tmp_path / "run"), "--new-chain"]) == 0
    sc.manager(tmp_path)
    root = tmp_path / "again"
    sc.prepare("new_chain", root)
    _crash("new_chain", root, "new_chain.swapped")  # after the commit point, before the head's rewrite
    m = sc.manager(root)
    rows = ckpt.Ledger(sc.ledger_path(root)).rows()
    assert rows[0].event == "chain_break"
    assert [r.step for r in rows[1:]] == [1, 2]
    assert m.latest() == sc.checkpoints(root) / "step-2"


# -- 2. a crash after the first save of a run resumed from another run directory ----------------------------


def test_a_finetunes_first_save_committed_before_a_crash_is_recovered(tmp_path: Path) -> None:
    sc.prepare("finetune", tmp_path)
    _crash("finetune", tmp_path, "save.committed")
    parent = read_manifest(tmp_path / "source" / "checkpoints" / "step-2")[1]
    m = sc.manager(tmp_path)  # on main: "committed on disk but missing from the ledger"
    rows = ckpt.Ledger(sc.ledger_path(tmp_path)).rows()
    assert [(r.step, r.recovered, r.parent_manifest_sha256) for r in rows] == [(3, True, parent)]
    report = audit(ckpt.Ledger(sc.ledger_path(tmp_path)))
    assert report.ok, report.problems
    assert any("resumed from another run's checkpoint" in n for n in report.notes)
    assert m.latest() == sc.checkpoints(tmp_path) / "step-3"


# -- 3. quarantine records first; latest and the signature follow --------------------------------------------


def test_a_quarantine_interrupted_after_its_row_is_finished_and_never_a_deletion(tmp_path: Path, capsys) -> None:
    sc.prepare("quarantine", tmp_path)
    _crash("quarantine", tmp_path, "quarantine.recorded")
    directory = sc.checkpoints(tmp_path)
    assert (directory / "step-2").is_dir()  # recorded, not moved yet
    assert cli.main(["lineage", str(tmp_path / "run")]) == 0  # the row accounts for it: nothing "deleted"
    assert "--record-deletions" not in capsys.readouterr().err
    m = sc.manager(tmp_path)  # finishes the move the row names
    moved = json.loads(ckpt.Ledger(sc.ledger_path(tmp_path)).rows()[-1].detail)["moved_to"]
    assert (sc.ledger_path(tmp_path).parent / moved).is_dir()
    assert not (directory / "step-2").exists()
    assert signature_path_for(sc.ledger_path(tmp_path).parent / moved).is_file()
    assert not signature_path_for(directory / "step-2").exists()
    assert m.latest() == directory / "step-1"


def test_a_quarantine_repoints_latest_and_moves_the_signature(tmp_path: Path) -> None:
    sc.prepare("quarantine", tmp_path)
    directory = sc.checkpoints(tmp_path)
    m = sc.manager(tmp_path)
    model, opt = _model()
    state = m.load("auto", model=model, optimizer=opt)
    assert state["step"] == 1
    (moved,) = m.moved_aside
    assert (directory / "latest").read_text().strip() == "step-1"  # not left naming the moved checkpoint
    assert signature_path_for(moved).read_text() == "{}"
    assert not signature_path_for(directory / "step-2").exists()  # a later step-2 will not meet a stale .sig


# -- 4. order by the ledger, not the clock; retention follows the live branch --------------------------------


class _SlowClock:
    """``datetime`` for save.py whose ``now`` is an hour behind (a node whose clock lags)."""

    timezone = datetime.timezone
    timedelta = datetime.timedelta

    class datetime(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return datetime.datetime.now(tz) - datetime.timedelta(hours=1)


def test_a_clock_behind_does_not_reorder_checkpoints(tmp_path: Path, monkeypatch) -> None:
    records_module = importlib.import_module("shardline.checkpoint.lifecycle.commit_records")  # reads the clock
    directory = tmp_path / "checkpoints"
    model, opt = _model()
    m = ckpt.CheckpointManager(directory, keep_last_n=2)
    _save(m, model, opt, 1)
    _save(m, model, opt, 2)
    monkeypatch.setattr(records_module, "datetime", _SlowClock)
    _save(m, model, opt, 3)  # written by a node whose clock is an hour behind
    monkeypatch.undo()
    created = {c.step: c.created_unix_ns for c in m.committed()}
    assert created[3] < created[2]
    assert _names(directory) == ["step-2", "step-3"]  # retention deleted step-1, not the new step-3
    m = ckpt.CheckpointManager(directory, keep_last_n=2)
    assert m.latest() == directory / "step-3"
    assert m.load("auto", model=model, optimizer=opt)["step"] == 3


def test_retention_follows_the_live_branch(tmp_path: Path) -> None:
    directory = tmp_path / "checkpoints"
    model, opt = _model()
    m = ckpt.CheckpointManager(directory, keep_last_n=3)
    for step in range(1, 6):
        _save(m, model, opt, step)
    assert _names(directory) == ["step-3", "step-4", "step-5"]
    m = ckpt.CheckpointManager(directory, keep_last_n=3)
    assert m.load("step-3", model=model, optimizer=opt)["step"] == 3  # branch at step-3
    _save(m, model, opt, 31)
    # the live branch is 1-2-3-31 and ranks newest: step-3 (the branch point) stays; of the abandoned 4 and 5,
    # only the newest fills the third place
    assert _names(directory) == ["step-3", "step-31", "step-5"]
    _save(m, model, opt, 32)
    assert _names(directory) == ["step-3", "step-31", "step-32"]
    tombs = [r.checkpoint for r in ckpt.Ledger(directory / "lineage.sqlite").rows() if r.event == "tombstone"]
    assert tombs[-2:] == ["step-4", "step-5"]
    assert ckpt.audit(ckpt.Ledger(directory / "lineage.sqlite")).ok
    m = ckpt.CheckpointManager(directory, keep_last_n=3)
    assert m.latest() == directory / "step-32"
    assert m.load("auto", model=model, optimizer=opt)["step"] == 32


# -- 5. retention after the agreement; its failure is a warning; a publish failure still chains --------------


def test_retention_runs_after_the_commit_and_its_failure_never_touches_the_chain(tmp_path: Path, monkeypatch) -> None:
    directory = tmp_path / "checkpoints"
    model, opt = _model()
    m = ckpt.CheckpointManager(directory, keep_last_n=1)
    _save(m, model, opt, 1)
    seen: list[str | None] = []

    def failing_retention(**kwargs):
        seen.append(m.parent_manifest_hash)  # the commit is agreed and known to every rank by now
        raise OSError(errno.EIO, "Input/output error", str(directory / "step-1"))

    monkeypatch.setattr(manager_module, "apply_retention", failing_retention)
    with pytest.warns(CheckpointWarning, match=r"retention .* failed: OSError.*chain is intact"):
        info = _save(m, model, opt, 2)
    assert seen[-1] == info.manifest_hash
    assert m.parent_manifest_hash == info.manifest_hash
    monkeypatch.undo()
    info3 = _save(m, model, opt, 3)
    assert info3.parent_manifest_hash == info.manifest_hash
    assert _names(directory) == ["step-3"]
    assert ckpt.audit(ckpt.Ledger(directory / "lineage.sqlite")).ok


def test_a_failed_ledger_append_still_chains_the_next_save(tmp_path: Path, monkeypatch) -> None:
    directory = tmp_path / "checkpoints"
    model, opt = _model()
    m = ckpt.CheckpointManager(directory)
    first = _save(m, model, opt, 1)
    real = ckpt.Ledger.append

    def disk_full(self, **kwargs):
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(ckpt.Ledger, "append", disk_full)
    with pytest.raises(PublishError, match="committed") as raised:
        _save(m, model, opt, 2)
    second = raised.value.info
    assert m.parent_manifest_hash == second.manifest_hash  # chained to the committed step-2, not step-1
    monkeypatch.setattr(ckpt.Ledger, "append", real)
    third = _save(m, model, opt, 3)
    assert third.parent_manifest_hash == second.manifest_hash != first.manifest_hash
    rows = ckpt.Ledger(directory / "lineage.sqlite").rows()
    assert [(r.step, r.recovered) for r in rows] == [(1, False), (2, True), (3, False)]
    assert ckpt.audit(ckpt.Ledger(directory / "lineage.sqlite")).ok
    ckpt.CheckpointManager(directory)  # and it opens


# -- 6. only damage is damage ---------------------------------------------------------------------------------


def test_an_io_error_reading_the_manifest_hash_moves_nothing(tmp_path: Path, monkeypatch) -> None:
    directory = tmp_path / "checkpoints"
    model, opt = _model()
    m = ckpt.CheckpointManager(directory)
    _save(m, model, opt, 1)
    _save(m, model, opt, 2)
    real_bytes, real_text = Path.read_bytes, Path.read_text

    def eio(path: Path) -> None:
        if path.name == "manifest.sha256" and path.parent.name == "step-2":
            raise OSError(errno.EIO, "Input/output error", str(path))

    monkeypatch.setattr(Path, "read_bytes", lambda self: eio(self) or real_bytes(self))
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: eio(self) or real_text(self, *a, **k))
    with pytest.raises(CheckpointReadError, match=r"EIO.*not damage: nothing was moved"):
        m.load("auto", model=model, optimizer=opt)
    assert m.moved_aside == []
    monkeypatch.undo()
    assert _names(directory) == ["step-1", "step-2"]
    assert ckpt.CheckpointManager(directory).load("auto", model=model, optimizer=opt)["step"] == 2


def test_bytes_that_match_but_do_not_decode_stop_the_load_and_move_nothing(tmp_path: Path, monkeypatch) -> None:
    directory = tmp_path / "checkpoints"
    model, opt = _model()
    m = ckpt.CheckpointManager(directory)
    _save(m, model, opt, 1)
    _save(m, model, opt, 2)

    def newer_format(*args, **kwargs):
        raise RuntimeError("PytorchStreamReader failed reading zip archive: unsupported format version")

    monkeypatch.setattr(reading, "decode_tensor", lambda data: None)  # every item goes to torch.load
    monkeypatch.setattr(reading.torch, "load", newer_format)  # as after a torch upgrade
    with pytest.raises(CheckpointReadError, match=r"not damage.*written with torch \S+; this process runs torch"):
        m.load("auto", model=model, optimizer=opt)
    assert m.moved_aside == []
    assert _names(directory) == ["step-1", "step-2"]


def test_a_hash_mismatch_is_still_damage(tmp_path: Path) -> None:
    sc.prepare("quarantine", tmp_path)  # step-2 has a flipped byte
    with pytest.raises(IntegrityError, match="manifest records"):
        ckpt.load(sc.checkpoints(tmp_path) / "step-2", model=_model()[0])


# -- 8. async: load and resolve wait for a save in flight ----------------------------------------------------


class _Slow(SaveObserver):
    def __init__(self) -> None:
        self.release = threading.Event()
        self.hold = False

    def on_phase(self, phase: SavePhase, rank: int) -> None:
        if phase is SavePhase.BEFORE_MANIFEST and self.hold:
            self.release.wait(timeout=30)


def test_load_and_resolve_wait_for_an_async_save(tmp_path: Path) -> None:
    directory = tmp_path / "checkpoints"
    model, opt = _model()
    slow = _Slow()
    m = ckpt.CheckpointManager(directory, async_save=True, observer=slow)
    _save(m, model, opt, 1)
    m.wait()
    slow.hold = True
    _save(m, model, opt, 2)  # queued; its write is held before the manifest
    threading.Timer(0.3, slow.release.set).start()
    assert m.resolve("auto") == directory / "step-2"
    state = m.load("auto", model=model, optimizer=opt)
    assert state["step"] == 2
    assert m.parent_manifest_hash == read_manifest(directory / "step-2")[1]
    m.close()


# -- 9. durability -------------------------------------------------------------------------------------------


def test_fsync_dir_reports_an_io_error(tmp_path: Path, monkeypatch) -> None:
    def failing(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", failing)
    with pytest.raises(OSError, match="Input/output error"):
        fsync_dir(tmp_path)


def test_new_parent_directories_are_fsynced(tmp_path: Path, monkeypatch) -> None:
    opened: list[str] = []
    real_open = os.open

    def recording(path, flags, *args, **kwargs):
        if flags & getattr(os, "O_DIRECTORY", 0):
            opened.append(os.fspath(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", recording)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ckpt.save(tmp_path / "a" / "b" / "step-1", model=_model()[0], step=1)
    assert str(tmp_path / "a") in opened  # the new "b" is an entry of "a"
    assert str(tmp_path) in opened  # and the new "a" one of tmp_path


def test_opening_a_manager_leaves_another_process_s_save_in_flight_alone(tmp_path: Path) -> None:
    directory = tmp_path / "checkpoints"
    ckpt.CheckpointManager(directory)
    saver = sc.start_holding_a_save(directory, tmp_path / "ready")
    try:
        tmp = Path((tmp_path / "ready").read_text())
        assert tmp.is_dir()
        ckpt.CheckpointManager(directory)  # a second process opens the same directory meanwhile
        assert tmp.is_dir(), "the temporary directory of a save in flight was removed"
    finally:
        saver.kill()
        saver.join()
    ckpt.CheckpointManager(directory)  # its owner is gone: now it is a leftover
    assert not tmp.exists()
    assert [p.name for p in directory.iterdir() if p.name.startswith(".")] == []


# -- 7. a failure on one rank after DCP's read is every rank's error, not a hang ----------------------------


def test_a_failure_after_the_read_on_one_rank_reaches_every_rank(saved_run: Path) -> None:
    from shardline.testing import run_distributed
    from tests.checkpoint import ranks

    results = run_distributed(ranks.load_failing_on_one_rank, 2, args=(str(saved_run / "step-4"),), timeout=60)
    assert results[0] == results[1], results  # the same error on both ranks; neither went on alone
    kind, message = results[0]
    assert kind == "CheckpointError", results
    assert "rank 1 could not install the state read from" in message
    assert "this rank cannot decode its trainer state" in message


def test_lightning_a_failed_ledger_append_raises_on_every_rank(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    from shardline.testing import run_distributed
    from tests.checkpoint import ranks

    results = run_distributed(ranks.lightning_append_fails_on_rank0, 2, args=(str(tmp_path),), timeout=60)
    assert results[0] == results[1], results  # rank 1 is not left in a barrier
    kind, message = results[0]
    assert kind == "PublishError", results
    assert "committed" in message
    assert "No space left on device" in message


def test_lightning_top_k_pruning_leaves_a_tombstone(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    from shardline.lightning import ShardlineStrategy

    directory = tmp_path / "ckpts"
    model, opt = _model()
    m = ckpt.CheckpointManager(directory)  # the strategy's ledger is lineage.sqlite beside the checkpoints
    _save(m, model, opt, 1)
    _save(m, model, opt, 2)
    ShardlineStrategy().remove_checkpoint(directory / "step-1")
    assert _names(directory) == ["step-2"]
    ledger = ckpt.Ledger(directory / "lineage.sqlite")
    tomb = ledger.rows()[-1]
    assert (tomb.event, tomb.checkpoint) == ("tombstone", "step-1")
    assert "ModelCheckpoint" in json.loads(tomb.detail)["reason"]
    report = ckpt.audit(ledger)
    assert report.ok, report.problems


def test_host_memory_running_out_on_rank0_alone_is_every_rank_s_error(tmp_path: Path) -> None:
    from shardline.testing import run_distributed
    from tests.checkpoint import ranks

    path = tmp_path / "step-1"
    results = run_distributed(ranks.full_save_out_of_host_memory_on_rank0, 2, args=(str(path),), timeout=60)
    assert results[0] == results[1], results  # neither rank waits in a gather the other left
    kind, message = results[0]
    assert kind == "StateDictError", results
    assert "ran out of host memory on this rank" in message
    assert "kind='sharded'" in message
    assert not path.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".step-1.tmp-")]
