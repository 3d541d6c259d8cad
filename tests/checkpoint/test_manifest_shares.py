"""At a load, a rank other than 0 receives of the manifest only what it checks: ``.metadata``'s entry in the
broadcast, and the entries of the data files it hashes in its DCP load plan -- not every rank's file list (17 MB
per rank at 16,384 ranks x 8 files). Rank 0 still checks the whole manifest."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan

from shardline.checkpoint.coordination import coord
from shardline.checkpoint.integrity.manifest import DCP_METADATA
from shardline.checkpoint.integrity.opening import CheckedManifest, check_manifest
from shardline.checkpoint.integrity.reading import VerifyingReader
from shardline.checkpoint.integrity.verify import VerifyLevel
from shardline.errors import CheckpointError
from shardline.testing import run_distributed
from tests.checkpoint import agreement_ranks
from tests.checkpoint.test_manifest_broadcast import _checkpoint


def test_what_a_load_broadcasts_of_the_manifest_does_not_grow_with_the_world(tmp_path: Path) -> None:
    sizes = {}
    for world in (4, 256):
        truth = check_manifest(_checkpoint(tmp_path, world), level=VerifyLevel.NONE)
        message = coord._encode({"value": truth.to_json(whole=False)})
        sizes[world] = len(message)
        got = CheckedManifest.from_json(coord._decode(message)["value"])  # as a rank other than 0 gets it
        assert got.entries() == [e for e in truth.entries() if e["path"] == DCP_METADATA]
        assert got.manifest_hash == truth.manifest_hash
        assert got.data_entries() == []
    # the same but for the directory's name (step-4, step-256), in one frame of coord (was 69 KB at 64 ranks)
    assert sizes[256] - sizes[4] == len("256") - len("4"), sizes
    assert sizes[256] < 4096 - 8, sizes


def test_each_rank_hashes_its_share_with_the_entries_its_load_plan_carries(tmp_path: Path) -> None:
    results = run_distributed(agreement_ranks.load_shares, 3, args=(str(tmp_path),), timeout=180)
    listed = {e["path"]: e for e in results[0]["listed"]}
    data = {p for p in listed if p != DCP_METADATA}
    assert results[0]["entries"] == results[0]["listed"], "rank 0 holds and checks the whole manifest"
    for out in results[1:]:
        assert [e["path"] for e in out["entries"]] == [DCP_METADATA], out["entries"]
        assert out["manifest_hash"] == results[0]["manifest_hash"]
    shares = [out["share"] for out in results]
    for share in shares:
        for entry in share:
            assert {k: listed[entry["path"]][k] for k in ("path", "bytes", "sha256")} == entry
    assert sorted(e["path"] for share in shares for e in share) == sorted(data), "disjoint, covering every file"


@pytest.mark.parametrize("storage_data", [None, {}])
def test_a_rank_whose_plan_lost_its_share_fails_closed(tmp_path: Path, storage_data: object) -> None:
    """A rank other than the coordinator has no entries of its own: with ``verify=True`` a plan without its share
    is refused, not read unverified."""
    reader = VerifyingReader(tmp_path, Metadata(state_dict_metadata={}, storage_data={}), to_hash=(), verify=True)
    with pytest.raises(CheckpointError, match="carries no hashing assignment"):
        reader.read_data(LoadPlan([], storage_data=storage_data), planner=None)  # type: ignore[arg-type]


def test_the_coordinator_sums_each_ranks_totals_instead_of_walking_its_read_items(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each rank totals its reads per file in its local plan step; rank 0 then never looks at a read item (35M of
    them at 16,384 ranks in the per-tensor layout). A plan that arrives without totals is totalled as before."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    from shardline.checkpoint.integrity import reading

    storage = {
        MetadataIndex(f"t{i}", (0,)): _StorageInfo(f"__{i % 2}_0.distcp", offset=100 * (i // 2), length=100)
        for i in range(6)
    }
    metadata = Metadata(state_dict_metadata={}, storage_data=storage)
    to_hash = [{"path": f"__{r}_0.distcp", "bytes": 300, "sha256": "0" * 64} for r in range(2)]
    reader = VerifyingReader(tmp_path, metadata, to_hash=to_hash)
    reader.set_up_storage_reader(metadata, is_coordinator=True)
    plans = [
        LoadPlan([ReadItem(LoadItemType.TENSOR, i, torch.Size([0]), i, torch.Size([0]), torch.Size([1])) for i in part])
        for part in (list(storage)[:4], list(storage)[4:])
    ]
    local = [reader.prepare_local_plan(p) for p in plans]
    assert [p.storage_data for p in local] == [
        {reading.READS_KEY: {"__0_0.distcp": 200, "__1_0.distcp": 200}},
        {reading.READS_KEY: {"__0_0.distcp": 100, "__1_0.distcp": 100}},
    ]
    walked: list[int] = []
    original = reading.VerifyingReader._reads_per_file

    def counting(self: VerifyingReader, items: list[ReadItem]) -> dict[str, int]:
        walked.append(len(items))
        return original(self, items)

    monkeypatch.setattr(reading.VerifyingReader, "_reads_per_file", counting)
    with_totals = reader.prepare_global_plan(local)
    assert walked == []
    without = reader.prepare_global_plan(plans)
    assert walked == [4, 2]
    assert [p.storage_data for p in with_totals] == [p.storage_data for p in without]  # the same shares either way
