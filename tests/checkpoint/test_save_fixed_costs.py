"""A save's fixed per-save costs, counted: gloo round trips beyond plain DCP's, and fsyncs (each path once).

At a small checkpoint these, not the bytes, decide how much a lineage save costs over plain DCP
(docs/benchmarks.md, "Checkpoint save and load overhead"), so the counts are pinned here.
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from benchmarks import floors
from torch import nn

import shardline.checkpoint as ckpt
from shardline.checkpoint.storage import calibration
from shardline.testing import run_distributed
from tests.checkpoint import fixed_cost_ranks

linux_only = pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="reads /proc/self/fd (Linux)")

_OPENS: list[list[str]] = []  # the lists counting_opens is filling (an audit hook cannot be removed: it idles)


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event == "open" and _OPENS and isinstance(args[0], (str, bytes, os.PathLike)):
        for opened in _OPENS:
            opened.append(os.fsdecode(args[0]))


@contextlib.contextmanager
def counting_opens() -> Iterator[list[str]]:
    """Every path this process opens meanwhile, on any thread (``open``, ``os.open``: the "open" audit event)."""
    if _audit not in _HOOKED:
        sys.addaudithook(_audit)
        _HOOKED.append(_audit)
    opened: list[str] = []
    _OPENS.append(opened)
    try:
        yield opened
    finally:
        _OPENS.remove(opened)


_HOOKED: list[Any] = []


def test_a_two_rank_save_costs_three_round_trips_beyond_plain_dcp(tmp_path: Path) -> None:  # save() and the manager
    """Preflight (rank 0 reserves), the capture's agreement (writability checked in it), the outcome: one each."""
    results = run_distributed(fixed_cost_ranks.save_collectives, 2, args=(str(tmp_path),), timeout=120)
    for out in results:
        assert out["verified"]
        assert out["payloads_ok"], "control messages, small and longer than a frame, arrive whole on every rank"
        assert out["ours"] - out["plain"] == 3, out
        assert out["manager"] - out["plain"] == 3, "CheckpointManager.save: the same three"
        assert out["small"] == 2, "a small broadcast and a small all-gather: one round trip each"
        assert out["large"] == 4, "a message longer than a frame: a second round trip for the rest"


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))  # unwrapped: one process, no group
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 64)).sum().backward()
    optimizer.step()
    return model, optimizer


@linux_only
def test_a_save_fsyncs_each_file_and_directory_once(tmp_path: Path, monkeypatch) -> None:
    """Every file of the checkpoint, its directory and the parent (the rename): each flushed exactly once."""
    model, optimizer = _model()
    ckpt.save(tmp_path / "warm", model=model, optimizer=optimizer, step=0, files_per_rank=2)
    flushed: list[int] = []
    real_fsync = os.fsync

    def spy(fd: int) -> None:
        flushed.append(os.fstat(fd).st_ino)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    info = ckpt.save(tmp_path / "step-1", model=model, optimizer=optimizer, step=1, files_per_rank=2)
    monkeypatch.setattr(os, "fsync", real_fsync)
    final = Path(info.path)
    expected = {p.stat().st_ino: p.name for p in [*final.iterdir(), final, tmp_path]}
    seen = {ino: flushed.count(ino) for ino in flushed}
    assert {expected.get(ino, ino): n for ino, n in seen.items() if n != 1} == {}, "flushed more than once"
    assert set(seen) == set(expected), sorted(expected[i] for i in set(expected) - set(seen))
    assert ckpt.verify_checkpoint(final).ok


def test_a_save_opens_each_commit_record_once(tmp_path: Path) -> None:
    """The four commit records are written and flushed through one descriptor each (not reopened to be fsynced)."""
    model, optimizer = _model()
    ckpt.save(tmp_path / "warm", model=model, optimizer=optimizer, step=0, files_per_rank=2)
    with counting_opens() as opened:
        info = ckpt.save(tmp_path / "step-1", model=model, optimizer=optimizer, step=1, files_per_rank=2)
    records = ("manifest.json", "manifest.sha256", "SHA256SUMS", "provenance.intoto.json")
    in_tmp = collections.Counter(Path(p).name for p in opened if Path(p).parent.name.startswith(".step-1.tmp-"))
    assert {name: in_tmp[name] for name in records} == dict.fromkeys(records, 1), in_tmp
    assert ckpt.verify_checkpoint(info.path).ok


def test_a_save_reads_the_calibration_cache_only_when_it_changed(tmp_path: Path, monkeypatch) -> None:
    """The location's calibration is looked up at every save; the cache file is opened again only after a change."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    model, optimizer = _model()
    ckpt.save(tmp_path / "warm", model=model, optimizer=optimizer, step=0, files_per_rank=2)  # probes, caches
    cache = calibration.cache_path()
    with counting_opens() as opened:
        for step in (1, 2):
            ckpt.save(tmp_path / f"step-{step}", model=model, optimizer=optimizer, step=step, files_per_rank=2)
    assert [p for p in opened if Path(p).parent == cache.parent] == []
    cache.write_text(cache.read_text() + " ")  # another process rewrote it: read again, once
    with counting_opens() as opened:
        for step in (3, 4):
            ckpt.save(tmp_path / f"step-{step}", model=model, optimizer=optimizer, step=step, files_per_rank=2)
    assert [p for p in opened if p == str(cache)] == [str(cache)]


def test_the_durable_floor_adds_the_measured_fixed_work_to_the_floor(tmp_path: Path) -> None:
    """benchmarks/floors.py: the four commit records made durable (written, fsynced with their directory, renamed
    into place, the parent fsynced) and a ledger commit, timed on the given storage, added to the floor (the ledger
    only where the save records a row); nothing is left behind."""
    fsynced: list[int] = []
    real_fsync = os.fsync

    def spy(fd: int) -> None:
        fsynced.append(fd)
        real_fsync(fd)

    os.fsync = spy  # the floor's fsync threads look os.fsync up when they run
    try:
        term = floors.fixed_cost(tmp_path, record_sizes=(1915, 881, 80, 403))
    finally:
        os.fsync = real_fsync
    # the records, their directory, the parent (the rename); then the ledger's commit (SQLite's own fsyncs, in C)
    assert len(fsynced) == 6
    assert term.records_s > 0
    assert term.ledger_s > 0
    assert term.round_trips_s == 0.0  # one process: no round trip
    assert list(tmp_path.iterdir()) == []
    assert floors.durable_floor_s(floor=1.0, fixed=term, ledger=False) == 1.0 + term.records_s
    assert floors.durable_floor_s(floor=1.0, fixed=term, ledger=True) == 1.0 + term.records_s + term.ledger_s
