"""Gradient accumulation with no_sync: equal to one big batch, and silent on the wire."""

from __future__ import annotations

import pytest
import torch

import shardline
from shardline.testing import GradientFault, run_distributed
from tests.models import (
    BATCH,
    SEQ,
    Block,
    ParityModel,
    batch,
    chain_terms,
    local_slice,
    loss_fn,
    parity_forward_terms,
)
from tests.numerics import Reorder, assert_caught, assert_reordered, max_rel_err
from tests.transports import TRANSPORTS, check_transports, counted, new_count, through

pytestmark = pytest.mark.numerics  # run again under another CPU kernel set by .ci/run

MICRO = 2
STRATEGIES = ("full_shard", "shard_grad_op", "no_shard")


def _accumulate(
    rank: int,
    world_size: int,
    strategy: str,
    reduce_dtype: torch.dtype | None,
    fault: GradientFault | None = None,
    transport: str = "all_reduce",
) -> dict:
    """Accumulate two micro-batches, the collectives through ``transport`` (``tests/transports.py``)."""
    torch.manual_seed(0)
    reference = ParityModel()
    torch.manual_seed(0)
    mp = shardline.MixedPrecision(reduce_dtype=reduce_dtype) if reduce_dtype else None
    model = shardline.wrap(ParityModel(), shardline.layer_policy(Block), strategy=strategy, mixed_precision=mp)
    tokens, targets = batch(0)
    loss_fn(reference(tokens), targets).backward()

    mine_t, mine_y = local_slice(tokens, rank, world_size), local_slice(targets, rank, world_size)
    micro_t, micro_y = mine_t.chunk(MICRO), mine_y.chunk(MICRO)
    comm = new_count()
    with (
        shardline.count_collectives(model) as inside,
        model.no_sync(),
        through(model, transport),
        counted(model, into=comm),
    ):
        for t, y in zip(micro_t[:-1], micro_y[:-1], strict=True):
            (loss_fn(model(t), y) / MICRO).backward()
    with shardline.count_collectives(model) as synced, through(model, transport, fault), counted(model, into=comm):
        (loss_fn(model(micro_t[-1]), micro_y[-1]) / MICRO).backward()

    # Every sharded gradient equals the reference's rows for this rank.
    errors = {}
    for unit in shardline.engine.subtree_units(model):
        for sp in unit.params:
            ref_param = reference.get_parameter(f"{unit.name + '.' if unit.name else ''}{sp.fqn}")
            if not sp.sharded.requires_grad:
                assert sp.sharded.grad is None
                continue
            full = ref_param.grad.reshape(sp.layout.rows, -1)
            rows = full[sp.layout.row_start : sp.layout.row_start + sp.layout.local_rows]
            errors[f"{unit.display_name}/{sp.fqn}"] = max_rel_err(sp.sharded.grad.reshape(rows.shape), rows)
    return {
        "errors": errors,
        "inside": [(r.kind.value, r.phase) for r in inside.records],
        "synced": [(r.kind.value, r.phase) for r in synced.records],
        "comm": comm,
    }


def _grid(rank: int, world_size: int) -> dict:
    out: dict = {"faults": {}, "ok": {}}
    for transport in TRANSPORTS:
        for s in STRATEGIES:
            for rd in (None, torch.float64):
                out["ok"][(s, str(rd), transport)] = _accumulate(rank, world_size, s, rd, None, transport)
            for fault in GradientFault:  # the same check must see a broken gradient reduction
                out["faults"][(s, fault.value, transport)] = _accumulate(rank, world_size, s, None, fault, transport)
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_no_sync_accumulation_equals_one_big_batch(world_size: int) -> None:
    results = run_distributed(_grid, world_size)
    rule = Reorder(chain_terms(forward=parity_forward_terms(), tokens=BATCH * SEQ, world_size=world_size, micro=MICRO))
    for (strategy, fault, transport), res in results[0]["faults"].items():
        assert_caught(res["errors"], rule, f"{strategy}, {fault}, {transport} transport")
    for (strategy, reduce_dtype, transport), res in results[0]["ok"].items():
        where = f"{strategy}/{reduce_dtype} W={world_size}, {transport} transport"
        assert_reordered(res["errors"], rule, f"{where}: accumulated gradients")
        if transport == "native":
            for rank_results in results:
                seen = {t: rank_results["ok"][(strategy, reduce_dtype, t)]["comm"] for t in TRANSPORTS}
                check_transports(seen, where, native_expected=strategy != "no_shard")
        kinds_inside = {kind for kind, _ in res["inside"]}
        # No gradient collective inside no_sync, for any strategy.
        assert not kinds_inside & {"reduce_scatter", "all_reduce"}, (strategy, res["inside"])
        if strategy == "no_shard":
            assert res["inside"] == []
            assert [k for k, _ in res["synced"]] == ["all_reduce"] * 3
        else:
            # Sharded units gather once, for the first micro-batch's forward, and then stay gathered.
            assert res["inside"] == [("all_gather", "forward")] * 3
            # The synced micro-batch: no forward gather (still gathered); backward re-gathers the block freed
            # after forward (FULL_SHARD only; the last block stays); one reduce-scatter per unit carries the total.
            gathers = [p for k, p in res["synced"] if k == "all_gather"]
            assert gathers == (["backward"] if strategy == "full_shard" else [])
            assert [k for k, _ in res["synced"]].count("reduce_scatter") == 3
