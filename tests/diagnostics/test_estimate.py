"""The memory estimator predicts what the engine then measures, within 10%, on the default model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import shardline
from shardline.diagnostics.estimate import estimate_memory
from shardline.models import GPT, Block
from shardline.testing import run_distributed

MICRO, SEQ = 8, 128
TOL = 0.10


def _default_model() -> GPT:
    return GPT(dim=128, n_layers=4, n_heads=4, seq_len=SEQ)


def _measured_activations(model: torch.nn.Module, tokens: torch.Tensor) -> int:
    """Bytes autograd's saved tensors really hold once forward is done, except the model's own state.

    Saved storages are counted by address at the end of forward, at their size then: gathered
    parameters the engine freed after forward have size 0 by then; parameters and buffers that
    are still there (registered on the model) are measured as their own components.
    """
    storages = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages.append(t.untyped_storage())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = F.cross_entropy(model(tokens).flatten(0, 1).float(), tokens.flatten())
    state = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    held = {s.data_ptr(): s.nbytes() for s in storages if s.nbytes() and s.data_ptr() not in state}
    loss.backward()
    return sum(held.values())


def _measure(
    rank: int, world_size: int, strategy: str, bf16: bool, build=None, micro: int = MICRO, seq: int = SEQ, **kwargs
) -> dict:
    mp = shardline.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    torch.manual_seed(0)
    model = (build or _default_model)()
    if strategy.startswith("hybrid"):
        kwargs["mesh"] = shardline.hybrid_mesh(shard_size=2)
    model = shardline.wrap(model, shardline.layer_policy(Block), strategy=strategy, mixed_precision=mp, **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 256, (micro, seq))
    F.cross_entropy(model(tokens).flatten(0, 1).float(), tokens.flatten()).backward()  # warm-up step
    opt.step()
    opt.zero_grad()
    shardline.reset_peak_memory_stats(model)
    activations = _measured_activations(model, tokens)
    opt.step()
    stats = shardline.memory_stats(model, optimizer=opt)
    return {
        "sharded_params": stats.sharded_params,
        "sharded_grads": stats.sharded_grads,
        "optimizer_state": stats.optimizer_state,
        "unsharded_params": stats.peak_unsharded_params,
        "comm_buffers": stats.peak_comm_buffers,
        "activations": activations,
    }


def _grid(rank: int, world_size: int) -> dict:
    return {
        (s, bf16): _measure(rank, world_size, s, bf16)
        for s in ("full_shard", "shard_grad_op", "no_shard", "shard_opt")
        for bf16 in (False, True)
    }


def _check(measured: dict, est, where: str) -> None:
    for component, value in measured.items():
        predicted = getattr(est, component)
        if value == 0:
            assert predicted == 0, f"{where} {component}: predicted {predicted}, measured 0"
            continue
        error = abs(predicted - value) / value
        assert error <= TOL, f"{where} {component}: predicted {predicted:,} vs measured {value:,} ({error:.1%})"


@pytest.mark.compat
@pytest.mark.parametrize("world_size", [2])
def test_estimate_matches_measured_accounting(world_size: int) -> None:
    measured = run_distributed(_grid, world_size, timeout=110)[0]
    for (strategy, bf16), got in measured.items():
        mp = shardline.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
        est = estimate_memory(
            _default_model,
            policy=shardline.layer_policy(Block),
            strategy=strategy,
            world_size=world_size,
            micro_batch_size=MICRO,
            seq_len=SEQ,
            mixed_precision=mp,
        )
        _check(got, est, f"{strategy} bf16={bf16}")


# Weights dominate: wide layers, one sequence of 16 tokens per rank. Saved weights (a linear
# layer keeps its weight for backward) would be 30x the real activations if counted as such.
WIDE_SEQ = 16


def _wide_model() -> GPT:
    return GPT(dim=384, n_layers=3, n_heads=6, seq_len=WIDE_SEQ)


WIDE = [
    ("full_shard", {}),
    ("full_shard", {"reshard_after_forward": 2}),
    ("hybrid_shard", {}),
    ("shard_opt", {}),
]


def _wide_grid(rank: int, world_size: int) -> list[dict]:
    return [_measure(rank, world_size, s, False, build=_wide_model, micro=1, seq=WIDE_SEQ, **kw) for s, kw in WIDE]


def test_estimate_where_weights_dominate() -> None:
    world = 4
    measured = run_distributed(_wide_grid, world, timeout=110)[0]
    weights = _wide_model().config.num_params * 4
    for (strategy, kwargs), got in zip(WIDE, measured, strict=True):
        est = estimate_memory(
            _wide_model,
            policy=shardline.layer_policy(Block),
            strategy=strategy,
            world_size=world,
            micro_batch_size=1,
            seq_len=WIDE_SEQ,
            shard_size=2 if strategy.startswith("hybrid") else None,
            **kwargs,
        )
        _check(got, est, f"{strategy} {kwargs}")
        assert got["activations"] < weights / 10, "the config is weights-dominated"


def test_estimate_scales_with_world_size_like_zero() -> None:
    policy = shardline.layer_policy(Block)
    kw = {"policy": policy, "micro_batch_size": MICRO, "seq_len": SEQ}
    one = estimate_memory(_default_model, strategy="zero3", world_size=1, **kw)
    four = estimate_memory(_default_model, strategy="zero3", world_size=4, **kw)
    ddp = estimate_memory(_default_model, strategy="ddp", world_size=4, **kw)
    assert one.parameters == four.parameters == _default_model().config.num_params
    # ZeRO-3 divides shards, gradients and optimizer state by W (up to padding); ZeRO-0 does not.
    assert abs(four.steady * 4 - one.steady) / one.steady < 0.01
    assert ddp.steady == one.steady
    assert four.activations == one.activations, "activations depend on the micro-batch only"
