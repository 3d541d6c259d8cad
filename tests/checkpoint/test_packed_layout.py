"""The packed layout's table: the row rule, segment cutting, source lookup, plain-data round trip."""

from __future__ import annotations

import random

import pytest
import torch

from shardline.checkpoint.format.packed_layout import (
    CheckpointLayout,
    MeshSpec,
    PackedEntry,
    PackedLayout,
    segment_key,
)
from shardline.errors import ConfigurationError, IntegrityError

pytestmark = pytest.mark.compat  # the packed layout rests on DTensor and DCP planner APIs: every torch in the matrix


def _random_layout(rng: random.Random) -> PackedLayout:
    world = rng.choice([2, 4, 6, 8])
    meshes = (MeshSpec((world,), tuple(range(world))), MeshSpec((2, world // 2), tuple(reversed(range(world)))))
    entries = []
    for i in range(rng.randint(1, 30)):
        mesh = rng.randint(0, 1)
        shard_dim = rng.choice([None, 0] if mesh == 0 else [None, 0, 1])
        shape = (rng.randint(1, 20), rng.randint(0, 3))
        entries.append(PackedEntry(f"k{i}", rng.choice(["float32", "bfloat16"]), shape, mesh, shard_dim))
    return PackedLayout(world, rng.choice([8, 64, 1000, 10**9]), meshes, tuple(entries))


@pytest.mark.parametrize("seed", range(40))
def test_the_vectorized_sizes_equal_each_ranks_segments_and_sources_cover_every_row_once(seed: int) -> None:
    layout = _random_layout(random.Random(seed))
    per_rank = {s.key: s.numel for r in range(layout.world_size) for s in layout.segments(r)}
    assert layout.expected_segment_sizes() == per_rank
    assert all(numel > 0 for numel in per_rank.values())
    for rank in range(layout.world_size):
        for segment in layout.segments(rank):
            assert segment.key == segment_key(rank, segment.dtype, segment.index)
            offsets = [p.offset for p in segment.pieces]
            assert offsets == sorted(offsets)
            assert offsets[0] == 0
            assert sum(p.numel for p in segment.pieces) == segment.numel
            if len(segment.pieces) > 1:  # a segment over the cap holds exactly one piece
                itemsize = getattr(torch, segment.dtype).itemsize
                assert segment.numel * itemsize <= layout.segment_bytes
    for i, entry in enumerate(layout.entries):
        if not entry.row_numel:
            assert all(layout.rows_of(i, r) is None for r in range(layout.world_size))
            continue
        spans = sorted((a, b) for _, a, b in layout.sources(i, 0, entry.shape[0]))
        assert spans[0][0] == 0
        assert spans[-1][1] == entry.shape[0]
        assert all(spans[j][1] == spans[j + 1][0] for j in range(len(spans) - 1))
        for rank, start, stop in layout.sources(i, 0, entry.shape[0]):
            _, piece = layout.locate(i, rank)
            assert (piece.start, piece.stop) == (start, stop) == layout.rows_of(i, rank)
    assert PackedLayout.from_data(layout.to_data(), where="here") == layout


@pytest.mark.parametrize(("rows", "world"), [(5, 4), (8192, 16), (3, 8), (17, 5)])
def test_the_row_rule_is_torch_chunks_split(rows: int, world: int) -> None:
    layout = PackedLayout(
        world, 2**20, (MeshSpec((world,), tuple(range(world))),), (PackedEntry("w", "float32", (rows, 2), 0, 0),)
    )
    chunks = torch.arange(rows).chunk(world)
    for rank in range(world):
        expected = (int(chunks[rank][0]), int(chunks[rank][-1]) + 1) if rank < len(chunks) else None
        assert layout.rows_of(0, rank) == expected


def test_a_replicated_dimension_writes_from_its_first_replica_only() -> None:
    mesh = MeshSpec((2, 2), (0, 1, 2, 3))  # (replica, shard)
    layout = PackedLayout(4, 2**20, (mesh,), (PackedEntry("w", "float32", (4, 1), 0, 1),))
    assert [layout.rows_of(0, r) for r in range(4)] == [(0, 2), (2, 4), None, None]
    assert layout.sources(0, 1, 3) == [(0, 1, 2), (1, 2, 3)]


def test_a_malformed_table_is_an_integrity_error_naming_the_checkpoint() -> None:
    layout = PackedLayout(2, 64, (MeshSpec((2,), (0, 1)),), (PackedEntry("w", "float32", (4,), 0, 0),))
    data = layout.to_data()
    for broken in (
        {**data, "version": 99},
        {**data, "meshes": [{"shape": [2], "ranks": [0, 5]}]},
        {**data, "entries": [["w", "float33", [4], 0, 0]]},
        {**data, "entries": [["w", "float32", [4], 3, 0]]},
        {k: v for k, v in data.items() if k != "entries"},
    ):
        with pytest.raises(IntegrityError, match="ckpt-7"):
            PackedLayout.from_data(broken, where="ckpt-7")


def test_layout_names_parse_with_aliases_and_refuse_others() -> None:
    assert CheckpointLayout.parse("Packed") is CheckpointLayout.PACKED
    assert CheckpointLayout.parse("per-tensor") is CheckpointLayout.PER_TENSOR
    assert CheckpointLayout.parse("dcp") is CheckpointLayout.PER_TENSOR
    with pytest.raises(ConfigurationError, match="per_tensor"):
        CheckpointLayout.parse("flat")


def test_segment_keys_are_recognized_by_the_module_that_names_them_and_nowhere_else() -> None:
    """One owner for the segment key's format: ``packed_layout`` makes the keys and recognizes them; no other
    module of the package defines its own test of the prefix."""
    from pathlib import Path

    from shardline.checkpoint.format import packed_layout

    assert packed_layout.is_segment_key(segment_key(12, "bfloat16", 3))
    assert not packed_layout.is_segment_key("model.layers.0.weight")
    assert not packed_layout.is_segment_key(packed_layout.SEGMENT_PREFIX + "x.r0.float32.s0")
    src = Path(packed_layout.__file__).parents[2]
    owners = sorted(
        str(path.relative_to(src))
        for path in src.rglob("*.py")
        if "def is_segment_key(" in path.read_text() or "SEGMENT_PREFIX +" in path.read_text()
    )
    assert owners == ["checkpoint/format/packed_layout.py"], owners
