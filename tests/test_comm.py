"""Collectives per step: how many, which unit, how many bytes -- checked against the theory."""

from __future__ import annotations

import math

import pytest
import torch

import shardline
from shardline.engine import TorchCollectives
from shardline.testing import run_distributed
from tests.models import Block, ParityModel, batch, local_slice, loss_fn

FP32 = 4


def _padded(shape: tuple[int, ...], world: int) -> int:
    """Elements one rank sends for a parameter: its torch.chunk piece padded to ceil(rows / world) rows."""
    rows = shape[0] if shape else 1
    return math.ceil(rows / world) * math.prod(shape[1:])


def _theory(world: int) -> dict[str, tuple[int, int, int]]:
    """Per unit: (all-gather bytes, reduce-scatter bytes, all-reduce bytes for NO_SHARD), from the shapes."""
    block = {  # name: (shape, trainable)
        "norm.weight": ((10,), True),
        "norm.bias": ((10,), True),
        "fc1.weight": ((7, 10), True),
        "fc1.bias": ((7,), True),
        "fc2.weight": ((10, 7), True),
        "fc2.bias": ((10,), True),
        "gate": ((2, 10), True),
        "frozen_bias": ((10,), False),
    }
    root = {"emb.weight": ((13, 10), True), "norm.weight": ((10,), True), "norm.bias": ((10,), True)}
    out = {}
    for unit, params in (("blocks.0", block), ("blocks.1", block), ("<root>", root)):
        gather = world * sum(_padded(s, world) for s, _ in params.values()) * FP32
        scatter = world * sum(_padded(s, world) for s, t in params.values() if t) * FP32
        reduce = sum(math.prod(s) for s, t in params.values() if t) * FP32
        out[unit] = (gather, scatter, reduce)
    return out


def _one_step(rank: int, world_size: int, strategy: str) -> list[tuple[str, str, str, int, str]]:
    torch.manual_seed(0)
    model = shardline.wrap(ParityModel(), shardline.layer_policy(Block), strategy=strategy)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens, targets = batch(0)
    tokens, targets = local_slice(tokens, rank, world_size), local_slice(targets, rank, world_size)
    loss_fn(model(tokens), targets).backward()  # warm-up step: lazy creation must not change counts
    opt.step()
    opt.zero_grad()
    shardline.reset_comm_stats(model)
    with shardline.count_collectives(model) as counter:
        loss_fn(model(tokens), targets).backward()
        opt.step()
    totals = shardline.comm_stats(model)
    assert totals.total_count == len(counter.records)
    assert totals.total_bytes == sum(r.bytes for r in counter.records)
    return [(r.kind.value, r.unit, r.phase, r.bytes, str(r.dtype)) for r in counter.records]


def _per_strategy(rank: int, world_size: int) -> dict:
    return {s: _one_step(rank, world_size, s) for s in ("full_shard", "shard_grad_op", "no_shard", "shard_opt")}


@pytest.mark.parametrize("world_size", [2, 3])
def test_collectives_per_step_match_theory(world_size: int) -> None:
    theory = _theory(world_size)
    results = run_distributed(_per_strategy, world_size)
    assert all(r == results[0] for r in results), "ranks issued different collectives"
    units = ["blocks.0", "blocks.1", "<root>"]

    def select(records, kind, phase=None):
        return [(u, b) for k, u, p, b, _ in records if k == kind and (phase is None or p == phase)]

    full = results[0]["full_shard"]
    # Forward: one all-gather per unit, root first.
    assert select(full, "all_gather", "forward") == [(u, theory[u][0]) for u in ["<root>", "blocks.0", "blocks.1"]]
    # Backward: blocks were freed after forward and are gathered again, except the root and the block
    # that ran last (backward starts with both, so they stay gathered).
    assert select(full, "all_gather", "backward") == [("blocks.0", theory["blocks.0"][0])]
    # One reduce-scatter per unit, as each finishes its backward; frozen parameters send nothing.
    assert select(full, "reduce_scatter") == [(u, theory[u][1]) for u in ["blocks.1", "blocks.0", "<root>"]]
    assert {k for k, *_ in full} == {"all_gather", "reduce_scatter"}
    assert all(dtype == "torch.float32" for *_, dtype in full)

    zero2 = results[0]["shard_grad_op"]
    assert select(zero2, "all_gather", "forward") == [(u, theory[u][0]) for u in ["<root>", "blocks.0", "blocks.1"]]
    assert select(zero2, "all_gather", "backward") == []
    assert sorted(select(zero2, "reduce_scatter")) == sorted((u, theory[u][1]) for u in units)

    ddp = results[0]["no_shard"]
    assert select(ddp, "all_gather") == []
    assert select(ddp, "reduce_scatter") == []
    assert sorted(select(ddp, "all_reduce")) == sorted((u, theory[u][2]) for u in units)

    # ZeRO-1: gradients all-reduced whole; the rows each rank's optimizer updated are all-gathered
    # (padded like a shard) in the next forward, once per unit.
    zero1 = results[0]["shard_opt"]
    assert sorted(select(zero1, "all_reduce")) == sorted((u, theory[u][2]) for u in units)
    assert sorted(select(zero1, "all_gather", "forward")) == sorted((u, theory[u][0]) for u in units)
    assert select(zero1, "reduce_scatter") == []
    assert {k for k, *_ in zero1} == {"all_gather", "all_reduce"}


def _gloo_via_all_reduce(rank: int, world_size: int) -> dict:
    """The all-reduce emulation of all-gather and reduce-scatter on gloo equals the native collectives bit for bit."""
    fast, native = TorchCollectives(), TorchCollectives(gloo_all_reduce=False)
    group = torch.distributed.group.WORLD
    g = torch.Generator().manual_seed(rank)
    shard = torch.randn(1001, generator=g)
    shard[:3] = torch.tensor([-0.0, float("nan"), float("-inf")])
    gathered = [torch.empty(world_size * 1001) for _ in range(2)]
    fast.all_gather(gathered[0], shard, group, async_op=False)
    native.all_gather(gathered[1], shard, group, async_op=False)
    full = torch.randn(world_size * 999, generator=g)
    outs = [torch.empty(999) for _ in range(2)]
    fast.reduce_scatter(outs[0], full.clone(), group, op=torch.distributed.ReduceOp.AVG, async_op=True).wait()
    native.reduce_scatter(outs[1], full.clone(), group, op=torch.distributed.ReduceOp.AVG, async_op=False)
    return {
        "gather_bits": torch.equal(gathered[0].view(torch.int32), gathered[1].view(torch.int32)),
        "scatter_bits": torch.equal(outs[0].view(torch.int32), outs[1].view(torch.int32)),
    }


@pytest.mark.compat
def test_gloo_all_reduce_emulation_is_exact() -> None:
    for result in run_distributed(_gloo_via_all_reduce, 3):
        assert result == {"gather_bits": True, "scatter_bits": True}


def _counter_filters(rank: int, world_size: int) -> None:
    model = shardline.fully_shard(torch.nn.Linear(4, 6))
    other = shardline.fully_shard(torch.nn.Linear(4, 6))
    with shardline.count_collectives(model) as outer:
        model(torch.ones(2, 4)).sum().backward()
        other(torch.ones(2, 4)).sum().backward()  # another model: counted by its own root only
        with shardline.count_collectives(model) as inner:
            model(torch.ones(2, 4)).sum().backward()
    assert outer.count() == 2 * inner.count() == 4
    assert inner.count("all_gather", unit="<root>", phase="forward") == 1
    assert inner.nbytes("reduce_scatter") == world_size * (3 * 4 + 3) * 4
    stats = shardline.comm_stats(model)
    assert stats.count("all_gather") == 2
    assert stats.count(shardline.CollectiveKind.REDUCE_SCATTER) == 2
    assert shardline.comm_stats(other).count("all_gather") == 1, "each model accounts for its own collectives"
    shardline.reset_comm_stats(model)
    assert shardline.comm_stats(model).total_count == 0
    assert shardline.comm_stats(other).total_count == 2


def test_counters_nest_and_filter() -> None:
    run_distributed(_counter_filters, 2)
