"""Rank 0 warns, once per process, when a per-tensor save records so many chunks that the packed layout pays off."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from shardline.checkpoint.integrity import chunk_count
from shardline.checkpoint.integrity.plan_validation import ShardlineSavePlanner
from shardline.errors import CheckpointWarning

WORLD, ROWS = 4, 2
KEYS = ("model.a", "model.b", "optim.state.a.exp_avg")  # 3 tensors x 4 ranks = 12 chunks


def _shard(key: str, rank: int) -> WriteItem:
    offsets = torch.Size([rank * ROWS, 0])
    data = TensorWriteData(
        chunk=ChunkStorageMetadata(offsets=offsets, sizes=torch.Size([ROWS, 3])),
        properties=TensorProperties(dtype=torch.float32),
        size=torch.Size([WORLD * ROWS, 3]),
    )
    return WriteItem(index=MetadataIndex(key, offsets), type=WriteItemType.SHARD, tensor_data=data)


def _global_plan() -> list[SavePlan]:
    """What rank 0's planner gathers from a per-tensor save of 3 row-sharded tensors over 4 ranks."""
    return [SavePlan([_shard(key, rank) for key in KEYS], planner_data={}) for rank in range(WORLD)]


def _plan(planner: ShardlineSavePlanner) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _, metadata = planner.create_global_plan(_global_plan())
    assert chunk_count.chunk_count(metadata) == WORLD * len(KEYS)
    return [w for w in seen if issubclass(w.category, CheckpointWarning)]


def test_a_per_tensor_plan_above_the_threshold_warns_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chunk_count, "_warned", False)
    monkeypatch.setattr(chunk_count, "MANY_CHUNKS", WORLD * len(KEYS))
    assert _plan(ShardlineSavePlanner()) == [], "at the threshold: no warning"
    monkeypatch.setattr(chunk_count, "MANY_CHUNKS", WORLD * len(KEYS) - 1)
    [warned] = _plan(ShardlineSavePlanner())
    message = str(warned.message)
    assert message.startswith("this per-tensor checkpoint records 12 tensor chunks (4 ranks x their tensors)"), message
    assert "layout='packed' (checkpoint.layout=packed" in message, message
    assert _plan(ShardlineSavePlanner()) == [], "a second save in the same process does not repeat it"


def test_the_warning_names_the_count_and_the_planning_cost_at_the_real_threshold(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """1M chunks (one tensor's list of chunk records; nothing planned): about 5 s of DCP's global plan at the
    measured 5 us per chunk, and an 82 MB .metadata."""
    monkeypatch.setattr(chunk_count, "_warned", False)
    chunk = ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([1]))

    def metadata(n: int) -> Metadata:
        return Metadata({"w": TensorStorageMetadata(TensorProperties(), torch.Size([n]), [chunk] * n)})

    assert chunk_count.MANY_CHUNKS == 1_000_000
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert chunk_count.warn_if_many_chunks(metadata(1_000_000), world_size=512) == 1_000_000
    assert not seen
    with pytest.warns(CheckpointWarning) as seen:
        assert chunk_count.warn_if_many_chunks(metadata(1_000_001), world_size=512) == 1_000_001
    message = str(seen[0].message)
    assert "records 1,000,001 tensor chunks (512 ranks x their tensors)" in message, message
    assert "about 5 s of CPU in DCP's global plan alone on every save (~5 us per chunk" in message, message
    assert "about 82 MB" in message, message


def test_a_packed_plan_does_not_warn(monkeypatch: pytest.MonkeyPatch) -> None:
    """The packed layout is what the warning recommends; its plan never triggers it (a packed planner skips the
    count). Here a packed planner whose table is empty plans the same per-tensor items."""
    from shardline.checkpoint.format.packed_layout import PackedLayout
    from shardline.checkpoint.integrity.packed_plan import PLAN_DIGEST_KEY, PackedSave, table_digest

    monkeypatch.setattr(chunk_count, "_warned", False)
    monkeypatch.setattr(chunk_count, "MANY_CHUNKS", 1)
    layout = PackedLayout(WORLD, 2**20, (), ())
    planner = ShardlineSavePlanner(layout="packed")
    planner.packed = PackedSave(layout, 0, {}, {})
    plans = [SavePlan(p.items, planner_data={PLAN_DIGEST_KEY: table_digest(layout)}) for p in _global_plan()]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        planner.create_global_plan(plans)
    assert not [w for w in seen if issubclass(w.category, CheckpointWarning)]
