"""clip_grad_norm_ equals torch.nn.utils.clip_grad_norm_ on the unsharded model, with one all-reduce."""

from __future__ import annotations

import itertools
import math

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
    full_grads,
    local_slice,
    loss_fn,
    parity_forward_terms,
)
from tests.numerics import Reorder, assert_caught, assert_reordered, max_rel_err
from tests.transports import TRANSPORTS, check_transports, counted, new_count, through

pytestmark = pytest.mark.numerics  # run again under another CPU kernel set by .ci/run


NORMS = (2.0, 1.0, math.inf)
CONFIGS = (("full_shard", "full_shard"), ("no_shard", "no_shard"), ("full_shard", "no_shard"))


def _clip(
    rank: int,
    world_size: int,
    blocks: str,
    root: str,
    fault: GradientFault | None = None,
    transport: str = "all_reduce",
) -> dict:
    """One step and a clip per norm type, the collectives through ``transport`` (``tests/transports.py``)."""
    out: dict = {"comm": new_count()}
    for norm_type in NORMS:
        torch.manual_seed(0)
        reference = ParityModel()
        torch.manual_seed(0)
        model = shardline.wrap(
            ParityModel(), shardline.layer_policy(Block), strategy=blocks, root_kwargs={"strategy": root}
        )
        tokens, targets = batch(0)
        loss_fn(reference(tokens), targets).backward()
        with through(model, transport, fault), counted(model, into=out["comm"]):
            loss_fn(model(local_slice(tokens, rank, world_size)), local_slice(targets, rank, world_size)).backward()
        max_norm = 0.5
        want = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm, norm_type)
        with shardline.count_collectives(model) as counter, through(model, transport), counted(model, into=out["comm"]):
            got = model.clip_grad_norm_(max_norm, norm_type)
        assert [r.kind.value for r in counter.records] == ["all_reduce"]
        grads = full_grads(model)
        errs = {n: max_rel_err(grads[n], p.grad) for n, p in reference.named_parameters() if p.grad is not None}
        out[norm_type] = (got.item(), want.item(), errs, want.item() > max_norm)
    return out


def _grid(rank: int, world_size: int) -> dict:
    out = {}
    for transport in TRANSPORTS:
        out.update({(b, r, transport): _clip(rank, world_size, b, r, None, transport) for b, r in CONFIGS})
        for fault in GradientFault:  # the same checks must see a broken gradient reduction
            out.update(
                {(b, r, transport, fault.value): _clip(rank, world_size, b, r, fault, transport) for b, r in CONFIGS}
            )
    return out


def test_clip_grad_norm_matches_torch() -> None:
    numel = sum(p.numel() for p in ParityModel().parameters())
    for world_size in (2, 3):
        results = run_distributed(_grid, world_size)
        # The gradients' chain, then the norm's sum over every element; clipping scales by that norm.
        grads = chain_terms(forward=parity_forward_terms(), tokens=BATCH * SEQ, world_size=world_size)
        rule = Reorder(grads + numel)
        for config, transport in itertools.product(CONFIGS, TRANSPORTS):
            key = (*config, transport)
            for norm_type, value in results[0][key].items():
                if norm_type == "comm":
                    continue
                got, want, grad_errs, clipped = value
                where = f"{config} W={world_size} norm {norm_type}, {transport} transport"
                assert clipped, "the test must actually clip"
                assert_reordered(abs(got - want) / want, rule, f"{where}: total norm")
                assert_reordered(grad_errs, rule, f"{where}: clipped gradients")
            for fault in GradientFault:
                for norm_type, value in results[0][(*key, fault.value)].items():
                    if norm_type == "comm":
                        continue
                    got, want, grad_errs, _ = value
                    # Clipping divides a uniform gradient scale out (the norm shows it); a missing
                    # reduction shows in the clipped gradients.
                    seen = {"total norm": abs(got - want) / want, **grad_errs}
                    where = f"{config} W={world_size} norm {norm_type}, {transport} transport, {fault.value}"
                    assert_caught(seen, rule, where)
            if transport == "native":
                for r in results:
                    seen_comm = {t: r[(*config, t)]["comm"] for t in TRANSPORTS}
                    check_transports(seen_comm, f"{config} W={world_size}", native_expected=config[0] != "no_shard")
        # Every rank returns the same total norm.
        norms = [{(k, n): v[0] for k in r if len(k) == 3 for n, v in r[k].items() if n != "comm"} for r in results]
        assert all(n == norms[0] for n in norms)
