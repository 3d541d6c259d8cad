"""The engine's memory accounting: what it holds, by component, matches the layout arithmetic."""

from __future__ import annotations

import torch

import shardline
from shardline.engine import subtree_units
from shardline.testing import run_distributed
from tests.models import Block, ParityModel, batch, local_slice, loss_fn

FP32 = 4


def _measure(rank: int, world_size: int, strategy: str) -> dict:
    torch.manual_seed(0)
    model = shardline.wrap(ParityModel(n_blocks=3), shardline.layer_policy(Block), strategy=strategy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    units = subtree_units(model)
    groups = [(u, g) for u in units for g in u.groups]
    shard_bytes = sum(g.layout.shard_numel for _, g in groups) * FP32
    gathered = {
        u.display_name: sum(0 if g.aliased else g.layout.unsharded_numel * FP32 for g in u.groups) for u in units
    }
    grad_bytes = sum(g._grad_layout(g.trainable(), g.mesh.shard_size).shard_numel for _, g in groups) * FP32

    before = shardline.memory_stats(model)
    assert before.sharded_params == shard_bytes
    assert before.unsharded_params == before.comm_buffers == before.sharded_grads == 0

    during = []
    model.blocks[1].fc2.register_forward_hook(lambda *_: during.append(shardline.memory_stats(model).unsharded_params))
    shardline.reset_peak_memory_stats(model)
    tokens, targets = batch(0)
    loss_fn(model(local_slice(tokens, rank, world_size)), local_slice(targets, rank, world_size)).backward()
    after = shardline.memory_stats(model)
    opt.step()
    stepped = shardline.memory_stats(model, optimizer=opt)
    local_numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    n_trainable = sum(1 for p in model.parameters() if p.requires_grad)
    return {
        "during": during[0],
        "gathered": gathered,
        "after_unsharded": after.unsharded_params,
        "after_comm": after.comm_buffers,
        "grads": after.sharded_grads,
        "grad_bytes": grad_bytes,
        "peak_unsharded": after.peak_unsharded_params,
        "peak_comm": after.peak_comm_buffers,
        "optimizer": stepped.optimizer_state,
        "expected_optimizer": 2 * local_numel * FP32 + n_trainable * FP32,  # exp_avg, exp_avg_sq, step
    }


def _grid(rank: int, world_size: int) -> dict:
    return {s: _measure(rank, world_size, s) for s in ("full_shard", "shard_grad_op", "no_shard")}


def test_memory_accounting_matches_the_layout() -> None:
    res = run_distributed(_grid, 2)[0]
    for strategy, r in res.items():
        assert r["after_unsharded"] == 0, f"{strategy}: everything is freed after backward"
        assert r["after_comm"] == 0, f"{strategy}: every communication buffer is released"
        assert r["grads"] == r["grad_bytes"], strategy
        assert r["optimizer"] == r["expected_optimizer"], strategy
    full, zero2, ddp = res["full_shard"], res["shard_grad_op"], res["no_shard"]
    blocks = [full["gathered"][f"blocks.{i}"] for i in range(3)]
    # FULL_SHARD: while block 1 runs, the root and block 1 are gathered (block 0 was freed).
    assert full["during"] == full["gathered"]["<root>"] + blocks[1]
    assert full["peak_unsharded"] == full["gathered"]["<root>"] + max(blocks)
    # SHARD_GRAD_OP keeps every unit gathered from forward through backward.
    assert zero2["during"] == zero2["gathered"]["<root>"] + sum(blocks[:2])
    assert zero2["peak_unsharded"] == sum(zero2["gathered"].values())
    # NO_SHARD in fp32 computes on the replicas themselves: nothing gathered, no gather buffers.
    assert ddp["peak_unsharded"] == 0
    assert full["peak_comm"] > 0
