"""clip_grad_norm_ equals torch.nn.utils.clip_grad_norm_ on the unsharded model, with one all-reduce."""

from __future__ import annotations

import math

import pytest
import torch

import shardline
from shardline.engine import use_collectives
from shardline.testing import FaultyCollectives, GradientFault, run_distributed
from tests.models import (
    BATCH,
    SEQ,
    Block,
    ParityModel,
    batch,
    chain_terms,
    full_grads,
    local_slice,
    loss_fn,
    parity_forward_terms,
)
from tests.numerics import Reorder, assert_caught, assert_reordered, max_rel_err

pytestmark = pytest.mark.numerics  # run again under another CPU kernel set by .ci/run


NORMS = (2.0, 1.0, math.inf)
CONFIGS = (("full_shard", "full_shard"), ("no_shard", "no_shard"), ("full_shard", "no_shard"))


def _clip(rank: int, world_size: int, blocks: str, root: str, fault: GradientFault | None = None) -> dict:
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
        with use_collectives(model, FaultyCollectives(fault)) if fault else torch.enable_grad():
            loss_fn(model(local_slice(tokens, rank, world_size)), local_slice(targets, rank, world_size)).backward()
        max_norm = 0.5
        want = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm, norm_type)
        with shardline.count_collectives(model) as counter:
            got = model.clip_grad_norm_(max_norm, norm_type)
        assert [r.kind.value for r in counter.records] == ["all_reduce"]
        grads = full_grads(model)
        errs = {n: max_rel_err(grads[n], p.grad) for n, p in reference.named_parameters() if p.grad is not None}
        out[norm_type] = (got.item(), want.item(), errs, want.item() > max_norm)
    return out


def _grid(rank: int, world_size: int) -> dict:
    out = {(b, r): _clip(rank, world_size, b, r) for b, r in CONFIGS}
    for fault in GradientFault:  # the same checks must see a broken gradient reduction
        out.update({(b, r, fault.value): _clip(rank, world_size, b, r, fault) for b, r in CONFIGS})
    return out


def test_clip_grad_norm_matches_torch() -> None:
    numel = sum(p.numel() for p in ParityModel().parameters())
    for world_size in (2, 3):
        results = run_distributed(_grid, world_size)
        # The gradients' chain, then the norm's sum over every element; clipping scales by that norm.
        grads = chain_terms(forward=parity_forward_terms(), tokens=BATCH * SEQ, world_size=world_size)
        rule = Reorder(grads + numel)
        for config in CONFIGS:
            for norm_type, (got, want, grad_errs, clipped) in results[0][config].items():
                where = f"{config} W={world_size} norm {norm_type}"
                assert clipped, "the test must actually clip"
                assert_reordered(abs(got - want) / want, rule, f"{where}: total norm")
                assert_reordered(grad_errs, rule, f"{where}: clipped gradients")
            for fault in GradientFault:
                for norm_type, (got, want, grad_errs, _) in results[0][(*config, fault.value)].items():
                    # Clipping divides a uniform gradient scale out (the norm shows it); a missing
                    # reduction shows in the clipped gradients.
                    seen = {"total norm": abs(got - want) / want, **grad_errs}
                    assert_caught(seen, rule, f"{config} W={world_size} norm {norm_type}, {fault.value}")
        # Every rank returns the same total norm.
        norms = [{(c, n): v[0] for c in CONFIGS for n, v in r[c].items()} for r in results]
        assert all(n == norms[0] for n in norms)
