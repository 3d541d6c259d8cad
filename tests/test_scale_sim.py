"""The checkpoint protocol's costs grow no faster than they should as the world grows.

``benchmarks/scale_sim.py`` runs shardline's own commit, manifest, load-planning and
resume-selection code for W ranks in this process; here at W = 64 and 1,024 (a 2-layer Llama
with the 70B's shapes: the per-file costs do not depend on the layers). Each cost's log-log slope
between the two must stay under its bound, so a change that makes a cost quadratic in W fails
here; a cost injected into the save's manifest builder shows that the check catches one.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence

import pytest
from benchmarks import scale_ledger, scale_sim

from shardline.checkpoint.integrity.hashing import FileDigest
from shardline.checkpoint.integrity.reading import assign_hashing
from shardline.checkpoint.lifecycle import commit_records
from shardline.checkpoint.storage.key_prefixes import RANKS_PER_PREFIX, max_objects_per_prefix

WORLDS = (64, 1024)

# Linear in W: the files rank 0 lists and hashes, the chunks DCP records, the plans rank 0 combines.
# (A rank's load plan by torch's resharding planner is linear too: it looks at every saved chunk.)
LINEAR = {
    "commit_rank0_s": 1.4,
    "build_manifest_s": 1.4,
    "canonical_json_s": 1.4,
    "load_global_plan_s": 1.4,
    "load_plan_per_rank_s": 1.4,
    "metadata_open_per_rank_s": 1.4,
    "resume_select_s": 1.4,
    "dcp_global_plan_s": 1.4,
    "shardline_validate_s": 1.4,  # shardline's save planner's check of the global plan: O(n log n)
    "dcp_finish_s": 1.4,
    "manifest_bytes": 1.05,
    "sums_bytes": 1.05,
    "gathered_bytes": 1.05,
    "dcp_metadata_bytes": 1.05,
    # one PUT per file below s3fs's 50 MiB upload part: the objects, once files are smaller than a part
    "save_requests": 1.05,
    # rank 0's listing check before the commit: one directory listing and two sets
    "listing_check_s": 1.4,
    # the whole checked manifest (check_checkpoint returns it on every rank): bytes, rank 0's encoding, each
    # rank's check and parse
    "manifest_broadcast_bytes": 1.05,
    "manifest_broadcast_rank0_s": 1.4,
    "manifest_receive_per_rank_s": 1.4,
}
# Nearly flat: the requests of a verified load are dominated by the model's bytes (8 MiB ranged GETs), not the
# ranks; the provenance statement names the manifest by its hash instead of listing every file.
# shardline's load planner finds each piece's saved chunk by its offsets and sizes: flat in W.
# What a load's rank receives of the manifest -- .metadata's entry, and its share of the data files' entries in its
# load plan -- and the elastic restart's count (one all-reduced int64): flat in W.
FLAT = {
    "load_requests": 0.3,
    "statement_bytes": 0.05,
    "load_plan_fast_per_rank_s": 0.3,
    "manifest_load_bytes_per_rank": 0.05,
    "restart_count_bytes_per_rank": 0.0,
}
# The packed layout (scale_packed.py): .metadata holds a segment per rank and dtype (W x dtypes items, the table
# O(tensors + W)), so rank 0's plan and the metadata grow with W at most; a rank's table build and local plan
# depend on the tensors, not on W (only the mesh's rank list grows).
LINEAR |= {
    "packed_global_plan_s": 1.4,
    "packed_plan_check_s": 1.4,
    "packed_finish_s": 1.4,
    "packed_metadata_open_per_rank_s": 1.4,
    "packed_metadata_items": 1.05,
    "packed_metadata_bytes": 1.05,
    "packed_gathered_bytes": 1.05,
    "packed_view_per_rank_s": 1.4,
}
FLAT |= {"packed_table_build_s": 0.5, "packed_local_plan_s": 0.5, "packed_load_plan_per_rank_s": 0.5}
# A bucket save spreads its data files over key prefixes of 256 ranks each: the fullest prefix stops growing there.
SUBLINEAR = {"objects_per_prefix": 0.55, "save_requests_per_prefix": 0.55}


def _measure() -> list[scale_sim.SimulatedSave]:
    # torch's validation of the global plan is quadratic in W (docs/benchmarks.md) and takes seconds at 1,024, so
    # it is left out here (validate_max_world=0); shardline's own (shardline_validate_s) is measured and bounded.
    return [
        scale_sim.simulate(w, layers=2, dcp_layers=1, keep=1, reps=3, validate_max_world=0, layout="packed")
        for w in WORLDS
    ]


def _over(rows: list[scale_sim.SimulatedSave]) -> dict[str, float]:
    slopes = scale_sim.exponents(rows)
    bounds = {**LINEAR, **FLAT, **SUBLINEAR}
    assert bounds.keys() <= slopes.keys(), sorted(bounds.keys() - slopes.keys())
    return {key: round(slopes[key], 2) for key, bound in bounds.items() if slopes[key] > bound}


def test_protocol_costs_scale_no_worse_than_linearly() -> None:
    rows = _measure()
    assert _over(rows) == {}, scale_sim.markdown(rows)
    small, large = rows
    assert large.values["manifest_bytes"] > small.values["manifest_bytes"] * 4  # every file is listed
    bound = max_objects_per_prefix(world=RANKS_PER_PREFIX, files_per_rank=8, spread=True)
    assert large.values["objects_per_prefix"] == bound, "W=1,024: no prefix holds more than 256 ranks' files"
    # packed: W x dtypes x segments per rank -- this 2-layer model's fp32 state is 682 MiB per rank at W=64, cut
    # into 10 segments to spread over 8 files (packed_spread.py), and 43 MiB at 1,024: one segment -- against a
    # chunk per rank and tensor in the per-tensor layout
    assert small.values["packed_metadata_items"] == 64 * 10
    assert large.values["packed_metadata_items"] == 1024
    assert large.values["packed_metadata_bytes"] * 10 < large.values["dcp_metadata_bytes"]
    # the gather: each rank's digests and one write result per segment, against one per tensor chunk (2 layers here:
    # 6x fewer bytes; 110x at 16,384 ranks of the 80-layer model, docs/benchmarks.md)
    assert large.values["packed_gathered_bytes"] * 4 < large.values["gathered_bytes"]
    # a load at the saving layout reads each of its own segments once: 10 at W=64, 1 at 1,024
    assert (small.values["packed_reads_per_rank"], large.values["packed_reads_per_rank"]) == (10, 1)


def test_the_object_store_floor_is_the_fullest_prefix_at_16k_ranks() -> None:
    """16,384 ranks x 8 files of 6.5 MB: one prefix held 131k objects and 37.5 s of PUTs; spread over 64 prefixes
    (256 ranks each), the fullest holds 2,048 data files and its PUTs take under a second."""
    digests = [
        FileDigest(path=f"__{r}_{n}.distcp", rank=r, bytes=6_500_000, sha256="0" * 64)
        for r in range(16_384)
        for n in range(8)
    ]
    records = {".metadata": 40 << 20, "manifest.json": 30 << 20, "SHA256SUMS": 12 << 20}
    flat = scale_sim._object_store(digests, records, 16_384, spread=False)
    spread = scale_sim._object_store(digests, records, 16_384)
    assert flat["objects_per_prefix"] == 131_075
    assert flat["save_floor_s"] > 37
    assert spread["objects_per_prefix"] == max_objects_per_prefix(world=16_384, files_per_rank=8, spread=True)
    assert spread["prefixes"] == 65  # 64 of data files, and the checkpoint's own
    assert spread["save_requests"] == flat["save_requests"]  # the same requests, spread
    assert spread["save_floor_s"] < 1
    assert spread["load_floor_s"] < 1


def test_an_injected_quadratic_cost_fails_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    real = commit_records.build_manifest

    def quadratic(**kwargs: object) -> dict[str, object]:
        paths = [f.path for f in kwargs["files"]]  # type: ignore[attr-defined]
        assert all(paths.index(p) == i for i, p in enumerate(paths))  # each file against every earlier one
        return real(**kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(commit_records, "build_manifest", quadratic)
    over = _over(_measure())
    assert "commit_rank0_s" in over, over


def _assign_by_scanning_every_rank(files: Mapping[str, int], reads: Sequence[Mapping[str, int]]) -> list[list[str]]:
    """The rule ``assign_hashing`` implements, written as its definition (files x ranks): the rank reading most of
    the file, then the fewest bytes to hash, then the fewest files, then the lowest rank."""
    load = [0] * len(reads)
    count = [0] * len(reads)
    out: list[list[str]] = [[] for _ in reads]
    for name, size in sorted(files.items(), key=lambda item: (-item[1], item[0])):
        best = max(range(len(reads)), key=lambda r: (reads[r].get(name, 0), -load[r], -count[r], -r))
        out[best].append(name)
        load[best] += size
        count[best] += 1
    return out


def test_files_of_no_bytes_that_no_rank_reads_spread_over_the_ranks() -> None:
    """At 16,384 ranks the ranks past 16,032 hold no rows and write empty files no rank reads: they went to one
    rank (2,816 entries, 277 KB of its load plan), now one each to the least loaded ranks."""
    files = {f"__{r}_0.distcp": (100 if r < 4 else 0) for r in range(12)}
    reads = [{f"__{r}_0.distcp": 100} if r < 4 else {} for r in range(12)]
    shares = assign_hashing(files, reads)
    assert shares[:4] == [[f"__{r}_0.distcp"] for r in range(4)]
    assert sorted(len(share) for share in shares[4:]) == [1] * 8


@pytest.mark.parametrize("seed", range(20))
def test_hashing_assignment_follows_its_rule(seed: int) -> None:
    rng = random.Random(seed)
    ranks = rng.randint(1, 9)
    files = {f"__{r}_{n}.distcp": rng.choice([0, 10, 10, 100, rng.randint(1, 500)]) for r in range(ranks) for n in
             range(rng.randint(1, 3))}  # fmt: skip
    reads = [
        {name: rng.choice([0, 5, 5, 60]) for name in rng.sample(sorted(files), rng.randint(0, len(files)))}
        for _ in range(ranks)
    ]
    assert assign_hashing(files, reads) == _assign_by_scanning_every_rank(files, reads)


@pytest.mark.parametrize("keep_last", [3, 0])
def test_ledger_reads_scale_no_worse_than_linearly(keep_last: int) -> None:
    """``shardline lineage``, resume selection and the report over a ledger 8x longer take at most ~8x longer
    (keep_last 0: every checkpoint kept, so resume selection has one candidate per row)."""
    small, large = (scale_ledger.ledger_scan(n, report=True, keep_last=keep_last) for n in (100, 800))
    slopes = {
        key: math.log(large[key] / small[key]) / math.log(large["rows"] / small["rows"])
        for key in ("lineage_s", "resume_select_s", "report_collect_s")
    }
    assert max(slopes.values()) < 1.4, slopes
