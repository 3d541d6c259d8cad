"""shardline's save planner validates the global plan as torch does, along the split dimension (O(n log n))."""

from __future__ import annotations

import dataclasses
import itertools
import random
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

import shardline.checkpoint as ckpt
from shardline._torch_compat import TORCH_PLAN_CHECK_FAILED, torch_validate_global_plan
from shardline.checkpoint.integrity.plan_validation import (
    ShardlineSavePlanner,
    overlapping_pairs,
    sweep_dimension,
    validate_global_plan,
)
from shardline.errors import CheckpointError

Chunk = ChunkStorageMetadata


def _cuts(n: int, pieces: int, rng: random.Random) -> list[tuple[int, int]]:
    """``pieces`` consecutive (start, length) ranges tiling [0, n), uneven, some possibly empty."""
    points = sorted(rng.randint(0, n) for _ in range(pieces - 1))
    edges = [0, *points, n]
    return [(a, b - a) for a, b in itertools.pairwise(edges)]


def _grid(size: tuple[int, ...], pieces: tuple[int, ...], rng: random.Random) -> list[Chunk]:
    """A valid layout: dimension d cut into ``pieces[d]`` ranges, every combination a chunk."""
    chunks = [Chunk(offsets=torch.Size([]), sizes=torch.Size([]))]
    for n, p in zip(size, pieces, strict=True):
        ranges = _cuts(n, p, rng)
        chunks = [
            Chunk(offsets=torch.Size([*c.offsets, o]), sizes=torch.Size([*c.sizes, s]))
            for c in chunks
            for o, s in ranges
        ]
    return chunks


def _layouts(rng: random.Random) -> list[tuple[str, tuple[int, ...], list[Chunk]]]:
    out = []
    for _ in range(6):
        rows, cols = rng.randint(1, 40), rng.randint(41, 90)
        out.append(("rows", (rows, cols), _grid((rows, cols), (rng.randint(2, 12), 1), rng)))
        out.append(("columns", (cols, rows), _grid((cols, rows), (1, rng.randint(2, 12)), rng)))
        out.append(("blocks", (rows, cols), _grid((rows, cols), (rng.randint(2, 5), rng.randint(2, 5)), rng)))
        out.append(("3-d", (rows, 7, cols), _grid((rows, 7, cols), (rng.randint(2, 4), 2, rng.randint(1, 3)), rng)))
    return out


def _with(
    chunks: list[Chunk], i: int, *, offsets: list[int] | None = None, sizes: list[int] | None = None
) -> list[Chunk]:
    c = chunks[i]
    new = Chunk(
        offsets=torch.Size(offsets if offsets is not None else c.offsets),
        sizes=torch.Size(sizes if sizes is not None else c.sizes),
    )
    return [*chunks[:i], new, *chunks[i + 1 :]]


def _broken(size: tuple[int, ...], chunks: list[Chunk], rng: random.Random) -> dict[str, list[Chunk]]:
    """Invalid variants of a valid layout: an overlap, a gap, out of bounds, and an overlap hidden by a gap."""
    nonempty = [i for i, c in enumerate(chunks) if all(c.sizes)]
    i = rng.choice(nonempty)
    c = chunks[i]
    d = max(range(len(size)), key=lambda k: len({x.offsets[k] for x in chunks}))  # a dimension the layout splits
    out = {"gap": _with(chunks, i, sizes=[s - (k == d) for k, s in enumerate(c.sizes)])}
    out["out of bounds"] = _with(chunks, i, offsets=[o + (k == d) * size[k] for k, o in enumerate(c.offsets)])
    # grow a chunk over its neighbour along d (one that starts where it ends), or back over the one before it
    if c.offsets[d] + c.sizes[d] < size[d]:
        out["overlap"] = _with(chunks, i, sizes=[s + (k == d) for k, s in enumerate(c.sizes)])
    else:
        grown = [o - (k == d) for k, o in enumerate(c.offsets)]
        out["overlap"] = _with(chunks, i, offsets=grown, sizes=[s + (k == d) for k, s in enumerate(c.sizes)])
    if c.offsets[d] > 0:  # shifted back by one: overlaps the chunk before, leaves a gap at its end; volume unchanged
        out["overlap + gap, same volume"] = _with(chunks, i, offsets=[o - (k == d) for k, o in enumerate(c.offsets)])
    return out


def _metadata(entries: dict[str, tuple[tuple[int, ...], list[Chunk]]]) -> Metadata:
    props = TensorProperties(dtype=torch.float32)
    return Metadata(
        state_dict_metadata={
            key: TensorStorageMetadata(properties=props, size=torch.Size(size), chunks=chunks)
            for key, (size, chunks) in entries.items()
        }
    )


def _kinds(errors: list[str]) -> dict[str, int]:
    kinds = ("out of bounds chunk", "overlapping chunks", "invalid fill")
    return {k: sum(k in e for e in errors) for k in kinds}


PLANS = [SavePlan([]), SavePlan([])]  # more than one rank: the volumes are checked too


def test_same_verdict_as_torch_on_valid_and_invalid_layouts() -> None:
    """Every check torch makes, with the same count of each kind of error, on valid and broken layouts."""
    rng = random.Random(7)
    seen_invalid: set[str] = set()
    for name, size, chunks in _layouts(rng):
        md = _metadata({f"w.{name}": (size, chunks)})
        assert torch_validate_global_plan(PLANS, md) == [], (name, chunks)
        assert validate_global_plan(PLANS, md) == [], (name, chunks)
        for bad, broken in _broken(size, chunks, rng).items():
            md = _metadata({f"w.{name}": (size, broken)})
            theirs, ours = torch_validate_global_plan(PLANS, md), validate_global_plan(PLANS, md)
            assert theirs, (name, bad, broken)
            assert ours, (name, bad, broken)
            if theirs != [TORCH_PLAN_CHECK_FAILED]:  # torch < 2.13 answers only valid/invalid
                assert _kinds(ours) == _kinds(theirs), (name, bad, ours, theirs)
            assert all(f"key:w.{name} " in e for e in ours), ours
            seen_invalid.add(bad)
    assert seen_invalid == {"gap", "out of bounds", "overlap", "overlap + gap, same volume"}


def test_errors_name_the_key_and_the_chunks() -> None:
    a = Chunk(offsets=torch.Size([0, 0]), sizes=torch.Size([3, 8]))
    b = Chunk(offsets=torch.Size([2, 0]), sizes=torch.Size([2, 8]))
    md = _metadata({"layers.0.k_proj.weight": ((4, 8), [a, b])})
    (overlap,) = [e for e in validate_global_plan(PLANS, md) if "overlapping" in e]
    assert overlap == f"key:layers.0.k_proj.weight has overlapping chunks: {b} {a}"


def _full_shard(rows: int, cols: int, world: int) -> list[Chunk]:
    """FULL_SHARD's dim-0 pieces of a (rows, cols) tensor over ``world`` ranks (empty pieces at the end)."""
    per = -(-rows // world)
    chunks = []
    for r in range(world):
        start = min(r * per, rows)
        chunks.append(Chunk(offsets=torch.Size([start, 0]), sizes=torch.Size([min(rows, start + per) - start, cols])))
    return chunks


def test_row_split_over_4096_ranks_is_one_pass_where_torchs_sweep_is_quadratic() -> None:
    """A (1024, 8192) tensor split by rows: swept along dim 0, each chunk meets at most one other."""
    world = 4096
    chunks = _full_shard(1024, 8192, world)
    assert sweep_dimension((1024, 8192), chunks) == 0
    _, compared = overlapping_pairs(chunks, 0)
    assert compared < world, compared
    assert validate_global_plan(PLANS, _metadata({"k": ((1024, 8192), chunks)})) == []
    # torch sweeps along the largest dimension (1): every chunk spans it, so every pair is compared
    small = 256
    _, theirs = overlapping_pairs(_full_shard(1024, 8192, small), 1)
    assert theirs == small * (small - 1) // 2
    _, ours = overlapping_pairs(_full_shard(1024, 8192, small), 0)
    assert theirs > 100 * ours, (theirs, ours)


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_a_shardline_save_validates_through_its_planner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    checked: list[int] = []
    real = ShardlineSavePlanner.validate_global_plan

    def spy(self: ShardlineSavePlanner, global_plan: list[SavePlan], metadata: Metadata) -> list[str]:
        checked.append(len(metadata.state_dict_metadata))
        return real(self, global_plan, metadata)

    monkeypatch.setattr(ShardlineSavePlanner, "validate_global_plan", spy)
    model, optimizer = _model()
    info = ckpt.save(tmp_path / "step-1", model=model, optimizer=optimizer, step=1)
    assert len(checked) == 1, checked
    assert checked[0] > 0, checked
    assert ckpt.verify_checkpoint(info.path).ok


def test_an_overlap_in_the_plan_is_refused_through_the_planner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two chunks of one tensor overlapping in a rank's plan: the save fails naming both, nothing is committed."""
    real = ShardlineSavePlanner.create_local_plan
    props = TensorProperties(dtype=torch.float32)

    def item(offset: int, rows: int) -> WriteItem:
        chunk = Chunk(offsets=torch.Size([offset, 0]), sizes=torch.Size([rows, 4]))
        data = TensorWriteData(chunk=chunk, properties=props, size=torch.Size([4, 4]))
        return WriteItem(index=MetadataIndex("injected", chunk.offsets), type=WriteItemType.SHARD, tensor_data=data)

    def with_overlap(self: ShardlineSavePlanner) -> SavePlan:
        plan = real(self)
        return dataclasses.replace(plan, items=[*plan.items, item(0, 3), item(2, 2)])

    monkeypatch.setattr(ShardlineSavePlanner, "create_local_plan", with_overlap)
    model, optimizer = _model()
    with pytest.raises(CheckpointError) as failure:
        ckpt.save(tmp_path / "step-1", model=model, optimizer=optimizer, step=1)
    message = str(failure.value)
    assert "key:injected has overlapping chunks" in message, message
    assert "offsets=torch.Size([2, 0])" in message, message
    assert not (tmp_path / "step-1").exists()


def test_the_planner_raises_valueerror_as_torchs_does() -> None:
    props = TensorProperties(dtype=torch.float32)
    plans = []
    for offset, rows in ((0, 3), (2, 2)):
        chunk = Chunk(offsets=torch.Size([offset, 0]), sizes=torch.Size([rows, 4]))
        data = TensorWriteData(chunk=chunk, properties=props, size=torch.Size([4, 4]))
        index = MetadataIndex("w", chunk.offsets)
        plans.append(SavePlan([WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=data)], planner_data={}))
    planner = ShardlineSavePlanner()
    with pytest.raises(ValueError, match=r"^Failed to validate global plan: key:w has overlapping chunks"):
        planner.create_global_plan(plans)
