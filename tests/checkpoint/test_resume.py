"""Resuming at the same world size continues bit-identically; lineage chains across resumes."""

from __future__ import annotations

import pytest

from shardline.checkpoint import Ledger
from shardline.checkpoint.integrity.manifest import read_manifest
from shardline.testing import run_distributed
from tests.checkpoint import ranks

pytestmark = [pytest.mark.numerics, pytest.mark.compat]  # run again under another CPU kernel set by .ci/run


def test_resume_is_bit_identical_and_chained(saved_run) -> None:
    # the uninterrupted run that saved step-2 and step-4 (losses recomputed here for reference)
    directory = saved_run.parent / "reference"
    reference = run_distributed(ranks.run_with_manager, 2, args=(str(directory), 6, [], False), timeout=60)[0]
    start, losses, parent = run_distributed(ranks.resume_and_train, 2, args=(str(saved_run), "auto", 6), timeout=60)[0]
    assert start == 4
    assert losses == reference[4:]  # exact float equality: same data, same RNG, same numerics
    assert parent == read_manifest(saved_run / "step-4")[1]
    start, losses, _ = run_distributed(ranks.resume_and_train, 2, args=(str(saved_run), "step-2", 6), timeout=60)[0]
    assert start == 2
    assert losses == reference[2:]


def test_async_save_matches_sync(tmp_path, saved_run) -> None:
    directory = tmp_path / "async"
    losses = run_distributed(ranks.run_with_manager, 2, args=(str(directory), 6, [2, 4], True), timeout=60)[0]
    sync = run_distributed(ranks.run_with_manager, 2, args=(str(tmp_path / "sync"), 6, [], False), timeout=60)[0]
    assert losses == sync  # saving in the background does not perturb training
    start, resumed, _ = run_distributed(ranks.resume_and_train, 2, args=(str(directory), "auto", 6), timeout=60)[0]
    assert start == 4
    assert resumed == sync[4:]
    rows = Ledger(directory / "lineage.sqlite").rows()
    assert [r.step for r in rows] == [2, 4]
    assert rows[1].parent_manifest_sha256 == rows[0].manifest_sha256 == read_manifest(directory / "step-2")[1]
    assert (directory / "latest").read_text().strip() == "step-4"
