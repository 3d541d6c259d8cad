"""A rank killed at any phase of a save: ``latest`` stays put, nothing partial is resumed, resume works."""

from __future__ import annotations

import pytest
import torch

from shardline.checkpoint import Ledger
from shardline.testing import FAULT_EXIT_CODE, RankFailedError, run_distributed
from tests.checkpoint import ranks

PHASES = [
    # (phase, the rank killed, is step-2 committed after the crash)
    ("after_shards", 1, False),
    ("before_manifest", 0, False),
    ("after_manifest", 0, False),
    ("after_rename", 0, True),
    ("after_latest", 0, True),
]


@pytest.mark.parametrize(("phase", "victim", "committed"), PHASES, ids=[f"{p[0]}:{p[1]}" for p in PHASES])
def test_killed_mid_save(tmp_path, phase, victim, committed) -> None:
    directory = tmp_path / "checkpoints"
    with pytest.raises(RankFailedError) as info:
        run_distributed(ranks.save_then_crash, 2, args=(str(directory), phase, victim), timeout=60)
    assert f"exited with code {FAULT_EXIT_CODE}" in str(info.value)
    assert (directory / "latest").read_text().strip() == ("step-2" if phase == "after_latest" else "step-1")
    assert (directory / "step-2").is_dir() == committed
    allowed = {"step-1", "latest", "lineage.sqlite", "lineage.sqlite.head"} | ({"step-2"} if committed else set())
    for entry in directory.iterdir():  # a partial save is at most a hidden temp directory
        assert entry.name in allowed or entry.name.startswith(".step-2.tmp-"), entry.name
    rows_before = Ledger(directory / "lineage.sqlite").rows()
    assert [r.step for r in rows_before] == [1]

    results = run_distributed(ranks.resume_step, 2, args=(str(directory),), timeout=60)
    step, snap = results[0]
    assert step == (2 if committed else 1)
    full, _ = ranks.unpack(snap)
    assert all(torch.isfinite(t).all() for t in full.values())
    # the new manager cleaned the partial save, repointed latest and recorded a recovered commit
    assert not [p for p in directory.iterdir() if p.name.startswith(".step-2.tmp-")]
    assert (directory / "latest").read_text().strip() == f"step-{step}"
    report = Ledger(directory / "lineage.sqlite").verify()
    assert report.ok, report.problems
    assert [(r.step, r.recovered) for r in report.rows] == ([(1, False), (2, True)] if committed else [(1, False)])
