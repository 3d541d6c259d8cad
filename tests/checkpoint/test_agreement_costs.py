"""The agreements of a save and a load, counted: where no caller needs the other ranks' results, agreeing that every
rank succeeded is one all-reduce of a 16-byte flag, whatever the world size -- not an all-gather of a 4 KiB frame
from every rank (67 MB received per rank per agreement at 16,384 ranks) -- and a failure is worded as before."""

from __future__ import annotations

from pathlib import Path

from shardline.testing import run_distributed
from tests.checkpoint import agreement_ranks

FLAG = 16  # the all-reduced int64 pair: failed ranks, and the amount summed (the bytes a save staged)


def test_the_agreements_of_a_save_and_a_load_receive_a_flag_not_every_ranks_frame(tmp_path: Path) -> None:
    results = run_distributed(agreement_ranks.agreement_costs, 2, args=(str(tmp_path),), timeout=180)
    for out in results:
        for step in ("save", "load", "check"):
            assert out[step]["received"].get("all_gather_single", 0) == 0, (step, out[step])
        # save: the capture's agreement (writability checked in it); load: the install; check: the hash shares
        assert out["save"]["calls"].get("all_reduce") == 1, out["save"]
        assert out["save"]["received"]["all_reduce"] == FLAG
        assert out["load"]["calls"].get("all_reduce") == 1, out["load"]
        assert out["load"]["received"]["all_reduce"] == FLAG
        assert out["check"]["calls"].get("all_reduce") == 1, out["check"]
        # the full state dicts: one all-gather left, the optimizer's structure check (it compares every rank's);
        # the model's and the optimizer's agreements are flags among the gathers' own all-reduces
        assert out["full_state"]["calls"]["all_gather_single"] == 1, out["full_state"]
    assert results[0]["total_bytes"] == results[1]["total_bytes"] > 0, "every rank's staged bytes, summed"


def test_a_failed_agreement_raises_what_all_agree_raised(tmp_path: Path) -> None:
    """One rank failing, every rank failing alike, every rank failing in its own words: ``all_succeed`` (and its
    counting form) raise on every rank the class and message ``all_agree`` raises; the payloads travel only then."""
    results = run_distributed(agreement_ranks.agreement_failures, 2, timeout=120)
    for out in results:
        for case in ("one rank", "every rank, same words", "every rank, own words"):
            got = out[case]
            assert got["all_agree"][0] != "no error", got
            assert got["all_succeed"] == got["all_agree"] == got["total"], (case, got)
            assert got["calls"] == {"all_reduce": 1, "all_gather_single": 1}, (case, got)
        assert out["sum"] == 30
    assert results[0]["one rank"]["all_succeed"] == ("IntegrityError", "rank 1 could not do the step: file damaged")
    assert results[0]["every rank, same words"]["all_succeed"] == ("IntegrityError", "disk gone")
    assert results[0]["every rank, own words"]["all_succeed"][1].startswith("rank 0 could not do the step: OSError")
