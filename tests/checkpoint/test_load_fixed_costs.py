"""A verified load's fixed per-load costs, counted: gloo round trips beyond plain DCP's load.

At a small checkpoint these, not the bytes, decide how much a verified load costs over plain
DCP's (docs/benchmarks.md, "Checkpoint save and load overhead"), so the count is pinned here.
"""

from __future__ import annotations

import collections
import pathlib
from pathlib import Path
from typing import Any

import torch
from benchmarks import floors
from torch import nn

import shardline.checkpoint as ckpt
from shardline.checkpoint.integrity.manifest import STATEMENT_FILE
from shardline.testing import run_distributed
from tests.checkpoint import fixed_cost_ranks


def test_a_two_rank_verified_load_costs_two_round_trips_beyond_plain_dcp(tmp_path: Path) -> None:
    """The anchored manifest from rank 0 (one frame), and the install's agreement: the model check rides in
    DCP's own plan step, the data files' verdict in DCP's read all-gather. A resume adds rank 0's choice of
    the checkpoint, and takes the manifest hash it chains to from the load (no round trip of its own)."""
    results = run_distributed(fixed_cost_ranks.load_collectives, 2, args=(str(tmp_path),), timeout=120)
    for out in results:
        assert out["restored"], "the verified load brought the saved values back"
        assert out["ours"] - out["plain"] == 2, out
        assert out["manager"] - out["plain"] == 3, "CheckpointManager.load('auto'): the same two, and the choice"
        assert out["chained"], "the next save chains to the manifest the load anchored"


def test_a_rank_that_cannot_prepare_fails_every_rank_before_anything_is_read(tmp_path: Path) -> None:
    """The preparation's verdicts ride in DCP's plan step: rank 1's failure is every rank's error, worded as an
    agreement words it, no rank's model is touched, and the group stays usable (nothing left half-done)."""
    results = run_distributed(fixed_cost_ranks.load_unprepared_on_one_rank, 2, args=(str(tmp_path),), timeout=120)
    assert results[0]["error"] == results[1]["error"], results
    kind, message = results[0]["error"]
    assert kind == "IntegrityError", results
    assert "rank 1 could not prepare to load" in message, message
    assert "this rank read a .metadata that does not match the manifest" in message, message
    for out in results:
        assert out["kept"], "nothing was read into any rank's model"
        assert out["loaded"], "a load after the failed one succeeds"


def test_a_load_reads_each_small_file_once(tmp_path: Path, monkeypatch) -> None:
    """The manifest, its hash file, SHA256SUMS, the statement and .metadata: each opened once by a verified load
    (on an object store each read is a request)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))  # unwrapped: one process, no group
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 16)).sum().backward()
    optimizer.step()
    info = ckpt.save(tmp_path / "step-1", model=model, optimizer=optimizer, step=1)
    opened: collections.Counter[str] = collections.Counter()
    real_open = pathlib.Path.open

    def spy(self: pathlib.Path, *args: Any, **kwargs: Any) -> Any:
        opened[self.name] += 1
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "open", spy)
    ckpt.load(info.path, model=model, optimizer=optimizer, verify="full")
    monkeypatch.setattr(pathlib.Path, "open", real_open)
    small = {name: n for name, n in opened.items() if not name.endswith(".distcp")}
    once = dict.fromkeys(("manifest.json", "manifest.sha256", "SHA256SUMS", STATEMENT_FILE, ".metadata"), 1)
    assert small == once, small


def test_the_verification_floor_adds_the_measured_fixed_work_of_a_load(tmp_path: Path) -> None:
    """benchmarks/floors.py: reading and hashing the checkpoint's manifest, timed on its storage, added to the
    load's floor (one process: no round trip)."""
    manifest = tmp_path / "manifest.json"
    manifest.write_bytes(b"{}" * 2048)
    term = floors.load_fixed_cost(manifest)
    assert term.manifest_s > 0
    assert term.round_trip_s == 0.0  # one process: no round trip
    assert term.total_s() == term.manifest_s
    assert floors.verification_floor_s(floor=1.0, fixed=term.total_s()) == 1.0 + term.manifest_s
