"""Sharded training equals one-process training on the same global batch."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import shardline
from shardline.testing import run_distributed
from tests.models import Block, ParityModel, batch, local_slice, loss_fn, max_rel_err

STEPS = 5
TOL = 1e-6

# (name, kwargs for blocks, overrides for the root)
CONFIGS = [
    ("full_shard", {"strategy": "full_shard"}, {}),
    ("shard_grad_op", {"strategy": "zero2"}, {}),
    ("no_shard", {"strategy": "ddp"}, {}),
    ("shard_opt", {"strategy": "zero1"}, {}),
    ("mixed: no_shard root, full_shard blocks", {"strategy": "full_shard"}, {"strategy": "no_shard"}),
    ("full_shard, root resharded too", {"strategy": "full_shard"}, {"reshard_after_forward": True}),
]


def _train(rank: int, world_size: int, blocks_kwargs: dict, root_kwargs: dict) -> dict:
    torch.manual_seed(0)
    reference = ParityModel()
    torch.manual_seed(0)
    model = ParityModel()
    shardline.wrap(model, shardline.layer_policy(Block), root_kwargs=root_kwargs, **blocks_kwargs)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)

    ref_losses, losses = [], []
    for step in range(STEPS):
        tokens, targets = batch(step)
        ref_loss = loss_fn(reference(tokens), targets)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()

        loss = loss_fn(model(local_slice(tokens, rank, world_size)), local_slice(targets, rank, world_size))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss, op=dist.ReduceOp.AVG)
        ref_losses.append(ref_loss.item())
        losses.append(global_loss.item())

    full = shardline.full_state_dict(model)
    expected = reference.state_dict()
    assert list(full) == list(expected)
    param_err = {key: max_rel_err(full[key], expected[key]) for key in expected}
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
        "param_err": param_err,
        "bitwise": bitwise,
        "local_numel": local_numel,
    }


def _grid(rank: int, world_size: int) -> dict:
    return {name: _train(rank, world_size, blocks, root) for name, blocks, root in CONFIGS}


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_sharded_training_matches_one_process(world_size: int) -> None:
    results = run_distributed(_grid, world_size, timeout=100)
    total = sum(p.numel() for p in ParityModel().parameters())
    for name, *_ in CONFIGS:
        per_rank = [r[name] for r in results]
        res = per_rank[0]
        for step, (got, want) in enumerate(zip(res["losses"], res["ref_losses"], strict=True)):
            assert abs(got - want) <= TOL * abs(want), f"{name}: step {step} loss {got} vs one-process {want}"
        worst = max(res["param_err"], key=res["param_err"].get)
        assert res["param_err"][worst] <= TOL, f"{name}: '{worst}' off by {res['param_err'][worst]:.2e} relative"
        if world_size == 1:
            assert res["losses"] == res["ref_losses"], f"{name}: W=1 losses not bitwise equal"
            assert res["bitwise"], f"{name}: W=1 parameters not bitwise equal to the plain model"
        # Sharded strategies hold ~1/W of the parameters per rank (the tied weight counts once).
        if name.startswith(("full_shard", "shard_grad_op", "shard_opt")):
            assert sum(r["local_numel"] for r in per_rank) == total
        if name == "no_shard":
            assert all(r["local_numel"] == total for r in per_rank)
