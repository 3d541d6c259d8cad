"""Sharded training equals one-process training on the same global batch."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

import shardline
from shardline.testing import GradientFault, run_distributed
from tests.models import (
    BATCH,
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
from tests.numerics import (
    Reorder,
    assert_caught,
    assert_reordered,
    assert_trajectories,
    assert_trajectory,
    trajectory_ratio,
)
from tests.transports import TRANSPORTS, check_transports, counted, new_count, through, transports_for

pytestmark = pytest.mark.numerics  # run again under another CPU kernel set by .ci/run

STEPS = 5

# (name, kwargs for blocks, overrides for the root)
CONFIGS = [
    ("full_shard", {"strategy": "full_shard"}, {}),
    ("shard_grad_op", {"strategy": "zero2"}, {}),
    ("no_shard", {"strategy": "ddp"}, {}),
    ("shard_opt", {"strategy": "zero1"}, {}),
    ("mixed: no_shard root, full_shard blocks", {"strategy": "full_shard"}, {"strategy": "no_shard"}),
    ("full_shard, root resharded too", {"strategy": "full_shard"}, {"reshard_after_forward": True}),
]


def _train(
    rank: int,
    world_size: int,
    blocks_kwargs: dict,
    root_kwargs: dict,
    fault: GradientFault | None = None,
    transport: str = "all_reduce",
) -> dict:
    """Train both models, the collectives through ``transport`` (``tests/transports.py``); with
    ``fault``, only the first step, through collectives with that bug."""
    torch.manual_seed(0)
    reference = ParityModel()
    torch.manual_seed(0)
    model = ParityModel()
    shardline.wrap(model, shardline.layer_policy(Block), root_kwargs=root_kwargs, **blocks_kwargs)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)

    ref_losses, losses = [], []
    comm = new_count()
    for step in range(STEPS):
        tokens, targets = batch(step)
        ref_loss = loss_fn(reference(tokens), targets)
        ref_loss.backward()

        with through(model, transport, fault), counted(model, into=comm):
            loss = loss_fn(model(local_slice(tokens, rank, world_size)), local_slice(targets, rank, world_size))
            loss.backward()
        if step == 0:  # the same parameters on both sides: the gradients differ by reordering alone
            first_grad_err = grad_errors(model, reference)
            if fault:
                return {"grad_err": first_grad_err}
        ref_opt.step()
        ref_opt.zero_grad()
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss, op=dist.ReduceOp.AVG)
        ref_losses.append(ref_loss.item())
        losses.append(global_loss.item())

    full = shardline.full_state_dict(model)
    expected = reference.state_dict()
    assert list(full) == list(expected)
    param_ratio = trajectory_ratio(full, expected)
    bitwise = all(torch.equal(full[key], expected[key]) for key in expected)

    # Optimizer state is as sharded as the parameters it belongs to.
    for param in model.parameters():
        for name, value in opt.state[param].items():
            if name != "step":
                assert value.shape == param.shape, (name, value.shape, param.shape)
    local_numel = sum(p.numel() for p in model.parameters())
    return {
        "ref_losses": ref_losses,
        "losses": losses,
        "grad_err": first_grad_err,
        "param_ratio": param_ratio,
        "bitwise": bitwise,
        "local_numel": local_numel,
        "comm": comm,
    }


def _grid(rank: int, world_size: int) -> dict:
    out = {}
    for transport in transports_for(world_size):
        for name, blocks, root in CONFIGS:
            out[(name, transport)] = _train(rank, world_size, blocks, root, transport=transport)
            if world_size > 1:  # the same checks must see a broken gradient reduction, on every strategy
                for fault in GradientFault:
                    out[(name, transport, fault.value)] = _train(rank, world_size, blocks, root, fault, transport)
    return out


@pytest.mark.parametrize("world_size", [1, pytest.param(2, marks=pytest.mark.compat), 3, 4])
def test_sharded_training_matches_one_process(world_size: int) -> None:
    results = run_distributed(_grid, world_size, timeout=100)
    total = sum(p.numel() for p in ParityModel().parameters())
    grads = Reorder(chain_terms(forward=parity_forward_terms(), tokens=BATCH * SEQ, world_size=world_size))
    for (name, *_), transport in itertools.product(CONFIGS, transports_for(world_size)):
        per_rank = [r[(name, transport)] for r in results]
        res = per_rank[0]
        where = f"{name}, W={world_size}, {transport} transport"
        assert_reordered(res["grad_err"], grads, f"{where}: first step's gradients")
        assert_trajectories(res["losses"], res["ref_losses"], where)
        assert_trajectory(res["param_ratio"], f"{where}: parameters after {STEPS} AdamW steps")
        if world_size > 1:
            for fault in GradientFault:
                caught = results[0][(name, transport, fault.value)]["grad_err"]
                assert_caught(caught, grads, f"{where} with {fault.value}")
        if transport == "native":  # same collectives and bytes either way; each transport's wire bytes
            for rank_results in results:
                seen = {t: rank_results[(name, t)]["comm"] for t in TRANSPORTS}
                check_transports(seen, where, native_expected=world_size > 1 and name != "no_shard")
        if world_size == 1:
            assert res["losses"] == res["ref_losses"], f"{name}: W=1 losses not bitwise equal"
            assert res["bitwise"], f"{name}: W=1 parameters not bitwise equal to the plain model"
        # Sharded strategies hold ~1/W of the parameters per rank (the tied weight counts once).
        if name.startswith(("full_shard", "shard_grad_op", "shard_opt")):
            assert sum(r["local_numel"] for r in per_rank) == total
        if name == "no_shard":
            assert all(r["local_numel"] == total for r in per_rank)
