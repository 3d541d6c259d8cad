"""Single-process unit tests: layout arithmetic, strategies, tree helpers."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, namedtuple

import pytest
import torch

from shardline import ConfigurationError, MixedPrecision, ShardingStrategy
from shardline._tree import iter_tensors, map_tensors
from shardline.engine.layout import UNSHARDED_ALIGN, FlatLayout, ParamLayout, shard_row_range


@pytest.mark.parametrize("rows", [0, 1, 2, 3, 5, 7, 8, 13])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_shards_match_torch_chunk(rows: int, world: int) -> None:
    full = torch.arange(rows * 3).reshape(rows, 3)
    chunks = torch.chunk(full, world, dim=0) if rows else ()
    pieces = []
    for rank in range(world):
        start, count = shard_row_range(rows, world, rank)
        expected = chunks[rank] if rank < len(chunks) else full[:0]
        assert torch.equal(full[start : start + count], expected), (rows, world, rank)
        pieces.append(full[start : start + count])
    assert torch.equal(torch.cat(pieces), full)


def test_flat_layout_offsets_and_padding() -> None:
    world = 3
    params = [ParamLayout.build(s, world, 2) for s in [(7, 10), (2,), (), (10,)]]
    layout = FlatLayout.build(params, world)
    # chunks: 3 rows x 10, 1, 1 (0-d as one row), 4
    assert [p.padded_numel for p in params] == [30, 1, 1, 4]
    assert layout.offsets == (0, 30, 31, 32)
    assert layout.shard_numel == 36
    # rank 2 of 3: rows 6..7 of 7, nothing of 2, nothing of the scalar, rows 8..10 of 10
    assert [(p.row_start, p.local_rows) for p in params] == [(6, 1), (2, 0), (1, 0), (8, 2)]
    assert params[2].shape == ()
    assert params[2].local_shape == (0,)
    assert all(off % UNSHARDED_ALIGN == 0 for off in layout.unsharded_offsets)
    assert layout.unsharded_numel >= world * layout.shard_numel


def test_strategy_aliases() -> None:
    parse = ShardingStrategy.parse
    assert parse("ddp") is parse("zero0") is parse("NO_SHARD") is ShardingStrategy.NO_SHARD
    assert parse("zero2") is parse("shard-grad-op") is ShardingStrategy.SHARD_GRAD_OP
    assert parse(" Zero3 ") is parse("full_shard") is parse(ShardingStrategy.FULL_SHARD) is ShardingStrategy.FULL_SHARD
    assert ShardingStrategy.FULL_SHARD == "full_shard"  # a str enum
    assert parse("zero1") is parse("SHARD_OPT") is ShardingStrategy.SHARD_OPT
    assert parse("hsdp") is parse("hybrid-shard") is ShardingStrategy.HYBRID_SHARD
    assert parse("hsdp_zero2") is ShardingStrategy.HYBRID_SHARD_ZERO2
    assert {s: s.zero_stage for s in ShardingStrategy} == {
        ShardingStrategy.NO_SHARD: 0,
        ShardingStrategy.SHARD_OPT: 1,
        ShardingStrategy.SHARD_GRAD_OP: 2,
        ShardingStrategy.FULL_SHARD: 3,
        ShardingStrategy.HYBRID_SHARD_ZERO2: 2,
        ShardingStrategy.HYBRID_SHARD: 3,
    }
    assert ShardingStrategy.FULL_SHARD.policy.reshard_after_forward
    assert not ShardingStrategy.SHARD_GRAD_OP.policy.reshard_after_forward
    assert not ShardingStrategy.NO_SHARD.policy.shard_params
    zero1 = ShardingStrategy.SHARD_OPT.policy
    assert zero1.shard_optimizer
    assert not zero1.shard_params
    assert zero1.replicated_params
    assert ShardingStrategy.HYBRID_SHARD.policy.hybrid
    assert not ShardingStrategy.FULL_SHARD.policy.hybrid
    with pytest.raises(ConfigurationError, match="Did you mean"):
        parse("zero_1x")


def test_mixed_precision_defaults() -> None:
    mp = MixedPrecision(param_dtype=torch.bfloat16)
    assert mp.compute_dtype(torch.float32) is torch.bfloat16
    assert mp.gradient_reduce_dtype(torch.float32) is torch.bfloat16
    assert (
        MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32).gradient_reduce_dtype(torch.float32)
        is torch.float32
    )
    assert MixedPrecision().compute_dtype(torch.float32) is torch.float32
    with pytest.raises(dataclasses.FrozenInstanceError):
        mp.param_dtype = torch.float16  # type: ignore[misc]


Pair = namedtuple("Pair", "a b")


@dataclasses.dataclass
class Box:
    x: torch.Tensor
    label: str


class Output(OrderedDict):
    pass


def test_tree_helpers_walk_and_rebuild_nested_containers() -> None:
    t1, t2, t3 = torch.ones(1), torch.zeros(2), torch.full((3,), 2.0)
    obj = {"pair": Pair(t1, [t2, None, 3]), "box": Box(t3, "x"), "out": Output(y=t1)}
    assert [t.numel() for t in iter_tensors(obj)] == [1, 2, 3, 1]
    doubled = map_tensors(lambda t: t * 2, obj)
    assert isinstance(doubled["pair"], Pair)
    assert doubled["pair"].b[1] is None
    assert doubled["pair"].b[2] == 3
    assert isinstance(doubled["box"], Box)
    assert doubled["box"].label == "x"
    assert torch.equal(doubled["box"].x, t3 * 2)
    assert isinstance(doubled["out"], Output)
    assert torch.equal(doubled["out"]["y"], t1 * 2)
    assert obj["box"].x is t3, "the input is not modified"
