"""The elastic restart's count, agreed with one all-reduce (MAX) of an int64 -- 8 bytes received per rank, whatever
the world size -- not an ``all_gather_object`` of every rank's pickled count (213 KB per rank at 16,384 ranks)."""

from __future__ import annotations

from shardline.testing import run_distributed
from tests.checkpoint import agreement_ranks


def test_the_restart_count_is_the_largest_over_the_ranks_in_one_small_all_reduce() -> None:
    world = 3  # counts 0, 2, 4: a node that joined counts from 0, the largest is the job's
    results = run_distributed(agreement_ranks.restart_count_costs, world, timeout=120)
    for out in results:
        for reader in ("count", "resume"):  # the ledger's restart record, and the implied resume=auto
            got = out[reader]
            assert got["value"] == 2 * (world - 1), got
            assert got["calls"] == {"all_reduce": 1}, got
            assert got["received"] == {"all_reduce": 8}, got
