"""shardline's load planner: a same-layout load examines O(1) saved chunks per piece, and plans what torch plans."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import ReadItem

from shardline.checkpoint.format.load_planner import ShardlineLoadPlanner
from shardline.testing import run_distributed
from tests.checkpoint import load_plan_ranks, ranks


class CountingChunks(list):
    """A tensor's saved chunks that count how many of them a planner looks at (indexed or iterated)."""

    examined = 0

    def __getitem__(self, i: Any) -> Any:
        CountingChunks.examined += 1
        return super().__getitem__(i)

    def __iter__(self) -> Iterator[Any]:
        for chunk in super().__iter__():
            CountingChunks.examined += 1
            yield chunk


class Piece(torch.Tensor):
    """A rank's piece of a sharded tensor as DCP's planners see one (its global size, a DTensor's
    ``__create_chunk_list__``), holding no data."""

    _shape: torch.Size
    _chunk: ChunkStorageMetadata

    @staticmethod
    def __new__(cls, shape: Sequence[int], chunk: ChunkStorageMetadata) -> Piece:
        piece = torch.Tensor._make_subclass(cls, torch.empty(0))
        piece._shape = torch.Size(shape)
        piece._chunk = chunk
        return piece

    def size(self, dim: int | None = None) -> Any:
        return self._shape if dim is None else self._shape[dim]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [self._chunk]


def _cuts(n: int, parts: int, rng: random.Random | None) -> list[int]:
    """Boundaries of ``parts`` pieces of ``n`` rows: torch.chunk's (ceil, empty pieces last) or random (uneven)."""
    if rng is None:
        step = -(-n // parts)
        return [min(i * step, n) for i in range(parts + 1)]
    return [0, *sorted(rng.randint(0, n) for _ in range(parts - 1)), n]


def layout(shape: Sequence[int], grid: Sequence[int], rng: random.Random | None = None) -> list[ChunkStorageMetadata]:
    """The boxes of a ``grid`` (pieces per dimension) over ``shape``, in rank order (the last dimension fastest)."""
    cuts = [_cuts(n, parts, rng) for n, parts in zip(shape, grid, strict=True)]
    boxes = []
    for index in itertools.product(*(range(parts) for parts in grid)):
        offsets = [cuts[d][i] for d, i in enumerate(index)]
        sizes = [cuts[d][i + 1] - cuts[d][i] for d, i in enumerate(index)]
        boxes.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
    return boxes


def metadata(tensors: dict[str, tuple[Sequence[int], list[ChunkStorageMetadata]]], counting: bool = False) -> Metadata:
    items: dict[str, Any] = {
        fqn: TensorStorageMetadata(
            properties=TensorProperties(dtype=torch.float32),
            size=torch.Size(shape),
            chunks=CountingChunks(chunks) if counting else chunks,
        )
        for fqn, (shape, chunks) in tensors.items()
    }
    items["trainer"] = BytesStorageMetadata()
    return Metadata(state_dict_metadata=items)


def plan(planner: DefaultLoadPlanner, state: dict[str, Any], md: Metadata) -> list[ReadItem]:
    planner.set_up_planner(state, md)
    return planner.create_local_plan().items


def described(items: list[ReadItem]) -> list[tuple[Any, ...]]:
    """Read items with the chunk positions their equality leaves out."""
    return [(item, item.dest_index.index, item.storage_index.index) for item in items]


def torch_planner() -> DefaultLoadPlanner:
    return DefaultLoadPlanner(flatten_state_dict=True, allow_partial_load=True)


def test_a_same_layout_load_examines_one_saved_chunk_per_piece() -> None:
    """A (1024, 8192) tensor over 4,096 ranks (1,024 hold a row, the others an empty piece): one chunk per rank."""
    shape, world = (1024, 8192), 4096
    boxes = layout(shape, (world, 1))
    md = metadata({"w": (shape, boxes)}, counting=True)
    per_rank = []
    for rank in range(world):
        CountingChunks.examined = 0
        items = plan(ShardlineLoadPlanner(rank=rank), {"w": Piece(shape, boxes[rank])}, md)
        per_rank.append(CountingChunks.examined)
        assert len(items) == (1 if rank < 1024 else 0)
    assert max(per_rank) == 1, sorted(set(per_rank))
    for rank in (0, 1, 1023, 1024, 4095):  # torch's planner, counted the same way, looks at every chunk
        CountingChunks.examined = 0
        expected = plan(torch_planner(), {"w": Piece(shape, boxes[rank])}, md)
        assert CountingChunks.examined >= world
        assert described(plan(ShardlineLoadPlanner(rank=rank), {"w": Piece(shape, boxes[rank])}, md)) == described(
            expected
        )


def test_without_the_rank_one_tensor_is_indexed_then_every_probe_hits() -> None:
    shape, world, rank = (1024, 64), 512, 300
    boxes = layout(shape, (world, 1))
    md = metadata({f"w{i}": (shape, boxes) for i in range(20)}, counting=True)
    CountingChunks.examined = 0
    items = plan(ShardlineLoadPlanner(rank=0), {f"w{i}": Piece(shape, boxes[rank]) for i in range(20)}, md)
    assert len(items) == 20
    # the first tensor: one probe missed (the rank and 0 are one position), its 512 chunks indexed (two passes: the
    # offsets, then the sizes), the match taken; the other 19: one probe each
    assert CountingChunks.examined == 1 + 2 * world + 1 + 19, CountingChunks.examined


CASES = [  # (shape, saved grid, loaded grid, uneven saved cuts)
    pytest.param((10, 6), (4, 1), (3, 1), False, id="W4-to-W3"),
    pytest.param((10, 6), (2, 1), (5, 1), False, id="W2-to-W5"),
    pytest.param((7, 6), (4, 1), (4, 1), True, id="uneven-to-even"),
    pytest.param((3, 5), (8, 1), (8, 1), False, id="same-with-empty-pieces"),
    pytest.param((8, 6), (2, 2), (4, 1), False, id="grid-to-rows"),
    pytest.param((8, 6), (4, 1), (1, 1), False, id="W4-to-whole"),
    pytest.param((9,), (3,), (3,), False, id="same-1d"),
]


def _compare(shape: Sequence[int], saved: list[ChunkStorageMetadata], loaded: list[ChunkStorageMetadata]) -> None:
    """Every loaded piece planned by both planners: the same items."""
    md = metadata({"w": (shape, saved)})
    for rank, box in enumerate(loaded):
        value: Any = torch.zeros(shape) if len(loaded) == 1 else Piece(shape, box)
        state = {"w": value, "trainer": None}
        expected = plan(torch_planner(), dict(state), md)
        planner = ShardlineLoadPlanner(rank=rank)
        assert described(plan(planner, dict(state), md)) == described(expected), (rank, box)
        if loaded == saved:  # the same layout: each piece found at its rank's position, no scan
            assert planner.finder.examined == 1, (rank, planner.finder.examined)


@pytest.mark.parametrize(("shape", "saved", "loaded", "uneven"), CASES)
def test_the_plan_is_torchs_on_these_layouts(shape, saved, loaded, uneven) -> None:
    rng = random.Random(0) if uneven else None
    _compare(shape, layout(shape, saved, rng), layout(shape, loaded))


@pytest.mark.parametrize("seed", range(30))
def test_the_plan_is_torchs_on_random_layouts(seed: int) -> None:
    rng = random.Random(seed)
    dims = rng.randint(1, 3)
    shape = [rng.randint(1, 9) for _ in range(dims)]

    def grid() -> list[int]:
        out = [1] * dims
        for d in rng.sample(range(dims), rng.randint(1, dims)):
            out[d] = rng.randint(1, 5)
        return out

    saved = layout(shape, grid(), rng if rng.random() < 0.5 else None)
    loaded = list(saved) if rng.random() < 0.5 else layout(shape, grid(), rng if rng.random() < 0.5 else None)
    assert sum(math.prod(c.sizes) for c in saved) == math.prod(shape)
    _compare(shape, saved, loaded)


@pytest.mark.parametrize(("strategy", "world"), [("full_shard", 2), ("hybrid_shard", 4)])
def test_a_save_and_load_at_the_same_layout_reads_every_piece_by_its_box(tmp_path, strategy, world) -> None:
    """Round trips through the planner: FULL_SHARD at W=2, and a 2x2 hybrid mesh (whose chunks DCP lists in another
    order per tensor: found by the index)."""
    path = str(tmp_path / "step-2")
    out = run_distributed(load_plan_ranks.save_then_load, world, args=(path, strategy), timeout=90)
    expected, loaded, by_torch, exact = out[0]
    from tests.checkpoint.test_reshard import _assert_equal

    _assert_equal(ranks.unpack(expected), ranks.unpack(loaded))
    for rank_out in out:
        _, _, by_torch, exact = rank_out
        assert exact > 10, exact  # every parameter piece and every moment of the optimizer
        assert all(kind != "tensor" for _, kind in by_torch), by_torch  # torch's planner: non-tensors and 0-d only
