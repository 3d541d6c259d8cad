"""A verified load's fixed per-load costs, counted: gloo round trips beyond plain DCP's load.

At a small checkpoint these, not the bytes, decide how much a verified load costs over plain
DCP's (docs/benchmarks.md, "Checkpoint save and load overhead"), so the count is pinned here.
"""

from __future__ import annotations

from pathlib import Path

from shardline.testing import run_distributed
from tests.checkpoint import fixed_cost_ranks


def test_a_two_rank_verified_load_costs_two_round_trips_beyond_plain_dcp(tmp_path: Path) -> None:
    """The anchored manifest from rank 0 (one frame), and the install's agreement: the model check rides in
    DCP's own plan step, the data files' verdict in DCP's read all-gather."""
    results = run_distributed(fixed_cost_ranks.load_collectives, 2, args=(str(tmp_path),), timeout=120)
    for out in results:
        assert out["restored"], "the verified load brought the saved values back"
        assert out["ours"] - out["plain"] == 2, out


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
