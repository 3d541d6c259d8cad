"""Prefetching and asynchronous collectives change no numerics, even when every collective lands late."""

from __future__ import annotations

import itertools

import torch

import shardline
from shardline.engine import use_collectives
from shardline.testing import DelayedCollectives, run_distributed
from tests.models import Block, ParityModel, batch, local_slice, loss_fn
from tests.transports import TRANSPORTS
from tests.transports import backend as transport_backend

PREFETCH = {
    "none": {"forward_prefetch": False, "backward_prefetch": None},
    "forward+backward_pre": {"forward_prefetch": True, "backward_prefetch": "backward_pre"},
    "backward_post": {"forward_prefetch": False, "backward_prefetch": "backward_post"},
}


def _train(
    rank: int, world_size: int, strategy: str, prefetch: dict, backend: DelayedCollectives | None
) -> tuple[list[float], dict]:
    torch.manual_seed(0)
    model = shardline.wrap(ParityModel(n_blocks=3), shardline.layer_policy(Block), strategy=strategy, **prefetch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(4):
        tokens, targets = batch(step)
        x, y = local_slice(tokens, rank, world_size), local_slice(targets, rank, world_size)
        with use_collectives(model, backend) if backend else torch.enable_grad():
            with model.no_sync():
                loss_fn(model(x[:1]), y[:1]).backward()
            loss = loss_fn(model(x[1:]), y[1:])
            loss.backward()
            model.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, shardline.full_state_dict(model)


def _grid(rank: int, world_size: int) -> dict:
    out = {}
    for strategy in ("full_shard", "shard_grad_op", "no_shard"):
        ref_losses, ref_state = _train(rank, world_size, strategy, PREFETCH["none"], None)
        for (name, prefetch), transport in itertools.product(PREFETCH.items(), TRANSPORTS):
            # gloo's all-reduce emulation and the native calls (NCCL's path) are bit-identical on gloo.
            backend = DelayedCollectives(0.005, inner=transport_backend(transport))
            losses, state = _train(rank, world_size, strategy, prefetch, backend)
            same = losses == ref_losses and all(torch.equal(state[k], ref_state[k]) for k in ref_state)
            out[(strategy, name, transport)] = (same, backend.delayed)
    return out


def test_prefetch_and_late_collectives_are_bit_identical() -> None:
    results = run_distributed(_grid, 2, timeout=110)[0]
    assert len(results) == 3 * len(PREFETCH) * len(TRANSPORTS)
    for (strategy, prefetch, transport), (same, delayed) in results.items():
        where = f"{strategy} with {prefetch} prefetching, {transport} transport"
        assert same, f"{where} and delayed collectives changed the numbers"
        assert delayed > 0, "the delay was actually exercised"


def _premature_read_is_caught(rank: int, world_size: int) -> bool:
    out = torch.zeros(4)
    backend = DelayedCollectives(0.01)
    work = backend.all_reduce(out, torch.distributed.group.WORLD, op=torch.distributed.ReduceOp.SUM, async_op=True)
    early = out.clone()
    work.wait()
    return bool(torch.isnan(early).all()) and bool(torch.equal(out, torch.zeros(4))) and backend.delayed == 1


def test_the_delay_injector_exposes_reads_before_wait() -> None:
    assert all(run_distributed(_premature_read_is_caught, 2))
