"""``reshard_after_forward=N``: after forward parameters stay split over N ranks, and backward gathers inside them."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import shardline
from shardline.engine import Residency, subtree_units
from shardline.testing import GradientFault, run_distributed
from tests.models import (
    SEQ,
    Block,
    ParityModel,
    batch,
    chain_terms,
    grad_errors,
    local_slice,
    loss_fn,
    parity_forward_terms,
)
from tests.numerics import Reorder, assert_caught, assert_reordered, assert_trajectory, injecting, trajectory_ratio

pytestmark = pytest.mark.numerics  # run again under another CPU kernel set by .ci/run


FP32 = 4


def _padded(shapes: list[tuple[int, ...]], ranks: int) -> int:
    """Elements per rank when each shape is split over ``ranks`` (torch.chunk rows, padded)."""
    return sum(math.ceil(s[0] / ranks) * math.prod(s[1:]) for s in shapes)


BLOCK = [(10,), (10,), (7, 10), (7,), (10, 7), (10,), (2, 10), (10,)]
ROOT = [(13, 10), (10,), (10,)]


def _run(rank: int, world_size: int, n: int, hybrid: bool, fault: GradientFault | None = None) -> dict:
    """Train both models; with ``fault``, only the first step, through collectives with that bug."""
    mesh = shardline.hybrid_mesh(replicate_size=1, shard_size=world_size) if hybrid else None
    torch.manual_seed(0)
    reference = ParityModel(n_blocks=3)
    torch.manual_seed(0)
    model = shardline.wrap(
        ParityModel(n_blocks=3),
        shardline.layer_policy(Block),
        strategy="hybrid_shard" if hybrid else "full_shard",
        mesh=mesh,
        reshard_after_forward=n,
    )
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    residency, held, records = {}, 0, []
    for step in range(3):
        tokens, targets = batch(step, 24)
        loss_fn(reference(tokens), targets).backward()
        with injecting(model, fault):
            out = model(local_slice(tokens, rank, world_size))
            if step == 2:
                residency = {u.display_name: u.residency for u in subtree_units(model)}
                held = shardline.memory_stats(model).unsharded_params
            with shardline.count_collectives(model) as counter:
                loss_fn(out, local_slice(targets, rank, world_size)).backward()
        records = [(r.kind.value, r.unit, r.bytes, r.group_size) for r in counter.records]
        if step == 0:  # the same parameters on both sides: the gradients differ by reordering alone
            first_grad_err = grad_errors(model, reference)
            if fault:
                return {"grad_err": first_grad_err}
        ref_opt.step()
        ref_opt.zero_grad()
        opt.step()
        opt.zero_grad()
    full = shardline.full_state_dict(model)
    expected = reference.state_dict()
    return {
        "grad_err": first_grad_err,
        "ratio": trajectory_ratio(full, expected),
        "residency": residency,
        "held": held,
        "backward": records,
        "after": shardline.memory_stats(model).unsharded_params,
    }


def _with_faults(rank: int, world_size: int, n: int, hybrid: bool) -> dict:
    out = {"ok": _run(rank, world_size, n, hybrid)}
    out.update({fault.value: _run(rank, world_size, n, hybrid, fault) for fault in GradientFault})
    return out


@pytest.mark.parametrize("hybrid", [False, True], ids=["full_shard", "hybrid_1x4"])
def test_partial_reshard_gathers_inside_the_group(hybrid: bool) -> None:
    world, n = 4, 2
    results = run_distributed(_with_faults, world, args=(n, hybrid), timeout=100)[0]
    res = results["ok"]
    rule = Reorder(chain_terms(forward=parity_forward_terms(n_blocks=3), tokens=24 * SEQ, world_size=world))
    assert_reordered(res["grad_err"], rule, "first step's gradients")
    assert_trajectory(res["ratio"], "parameters after 3 SGD steps")
    for fault in GradientFault:
        assert_caught(results[fault.value]["grad_err"], rule, f"with {fault.value}")
    # After forward: with an explicit N every unit (the root and the last block too) keeps its piece over N ranks.
    blocks = {f"blocks.{i}" for i in range(3)}
    assert res["residency"] == dict.fromkeys([*blocks, "<root>"], Residency.PARTIAL)
    # ...which holds 1/N of each unit, not 1/W (the shard) and not all of it (no reshard).
    assert res["held"] == (3 * _padded(BLOCK, n) + _padded(ROOT, n)) * FP32
    # Backward re-gathers each unit over its group of N ranks: N pieces of the 1/N split.
    gathers = sorted((u, b, g) for k, u, b, g in res["backward"] if k == "all_gather")
    expected = [(u, n * _padded(BLOCK, n) * FP32, n) for u in blocks] + [("<root>", n * _padded(ROOT, n) * FP32, n)]
    assert gathers == sorted(expected)
    # Gradients are still reduce-scattered over the whole shard group.
    scatters = {(u, g) for k, u, b, g in res["backward"] if k == "reduce_scatter"}
    assert scatters == {(u, world) for u in (*blocks, "<root>")}
    assert res["after"] == 0


def _equivalents(rank: int, world_size: int) -> dict:
    out = {}
    for n in (1, world_size):
        model = shardline.wrap(ParityModel(), shardline.layer_policy(Block), reshard_after_forward=n)
        tokens, targets = batch(0)
        with shardline.count_collectives(model) as counter:
            loss_fn(model(local_slice(tokens, rank, world_size)), local_slice(targets, rank, world_size)).backward()
        out[n] = sorted((r.unit, r.group_size) for r in counter.records if r.kind.value == "all_gather")
    dist.barrier()
    return out


def test_n_equal_to_one_or_the_shard_group_is_false_or_true() -> None:
    res = run_distributed(_equivalents, 2)[0]
    # N=1: nothing freed after forward, so no backward gathers: one all-gather per unit.
    assert res[1] == sorted([("<root>", 2), ("blocks.0", 2), ("blocks.1", 2)])
    # N=W: every unit (root included, as asked explicitly) is freed and gathered again over all ranks.
    assert res[2] == sorted(
        [("<root>", 2), ("<root>", 2), ("blocks.0", 2), ("blocks.0", 2), ("blocks.1", 2), ("blocks.1", 2)]
    )
