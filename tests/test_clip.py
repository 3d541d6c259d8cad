"""clip_grad_norm_ equals torch.nn.utils.clip_grad_norm_ on the unsharded model, with one all-reduce."""

from __future__ import annotations

import math

import torch

import shardline
from shardline.testing import run_distributed
from tests.models import Block, ParityModel, batch, local_slice, loss_fn, max_rel_err

NORMS = (2.0, 1.0, math.inf)


def _clip(rank: int, world_size: int, blocks: str, root: str) -> dict:
    out = {}
    for norm_type in NORMS:
        torch.manual_seed(0)
        reference = ParityModel()
        torch.manual_seed(0)
        model = shardline.wrap(
            ParityModel(), shardline.layer_policy(Block), strategy=blocks, root_kwargs={"strategy": root}
        )
        tokens, targets = batch(0)
        loss_fn(reference(tokens), targets).backward()
        loss_fn(model(local_slice(tokens, rank, world_size)), local_slice(targets, rank, world_size)).backward()
        max_norm = 0.5
        want = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm, norm_type)
        with shardline.count_collectives(model) as counter:
            got = model.clip_grad_norm_(max_norm, norm_type)
        assert [r.kind.value for r in counter.records] == ["all_reduce"]
        full_grads = _gather_grads(model)
        errs = [max_rel_err(full_grads[n], p.grad) for n, p in reference.named_parameters() if p.grad is not None]
        out[norm_type] = (got.item(), want.item(), max(errs), want.item() > max_norm)
    return out


def _gather_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full gradients, by loading the sharded grads into the parameters and gathering those."""
    saved = [(p, p.detach().clone()) for p in model.parameters()]
    with torch.no_grad():
        for p, _ in saved:
            p.copy_(p.grad if p.grad is not None else torch.zeros_like(p))
    grads = shardline.full_state_dict(model)
    with torch.no_grad():
        for p, value in saved:
            p.copy_(value)
    return grads


def _grid(rank: int, world_size: int) -> dict:
    return {
        (b, r): _clip(rank, world_size, b, r)
        for b, r in (("full_shard", "full_shard"), ("no_shard", "no_shard"), ("full_shard", "no_shard"))
    }


def test_clip_grad_norm_matches_torch() -> None:
    for world_size in (2, 3):
        results = run_distributed(_grid, world_size)
        for config, per_norm in results[0].items():
            for norm_type, (got, want, grad_err, clipped) in per_norm.items():
                assert abs(got - want) <= 1e-6 * want, f"{config} norm {norm_type}: {got} vs {want}"
                assert clipped, "the test must actually clip"
                assert grad_err <= 1e-6, f"{config} norm {norm_type}: clipped grads off by {grad_err:.2e}"
        # Every rank returns the same total norm.
        assert all(r == results[0] for r in results)
