"""trainer.precision (autocast) vs the strategy's mixed_precision (parameter and reduction dtypes)."""

from __future__ import annotations

import torch

import shardline
from shardline.models import GPT, Block
from shardline.testing import run_distributed
from shardline.train.precision import autocast, bf16_mixed_precision

F32, BF16 = "torch.float32", "torch.bfloat16"


def _observe(rank: int, world_size: int, precision: str, use_mp: bool) -> dict:
    torch.manual_seed(0)
    model = GPT(dim=32, n_layers=2, n_heads=2, seq_len=16)
    mp = bf16_mixed_precision() if use_mp else None
    shardline.wrap(model, shardline.layer_policy(Block), mixed_precision=mp)
    seen = {}
    model.blocks[0].mlp.fc.register_forward_hook(
        lambda m, args, out: seen.update(weight=str(m.weight.dtype), output=str(out.dtype))
    )
    tokens = torch.randint(0, 256, (2, 16))
    with shardline.count_collectives(model) as counter:
        with autocast(precision, "cpu"):
            logits = model(tokens)
        logits.float().sum().backward()
    reduce_dtypes = {str(r.dtype) for r in counter.records if r.kind.value == "reduce_scatter"}
    gather_dtypes = {str(r.dtype) for r in counter.records if r.kind.value == "all_gather"}
    grad_dtypes = {str(p.grad.dtype) for p in model.parameters() if p.grad is not None}
    return {**seen, "reduce": reduce_dtypes, "gather": gather_dtypes, "grads": grad_dtypes}


def _grid(rank: int, world_size: int) -> dict:
    return {(p, mp): _observe(rank, world_size, p, mp) for p in ("32-true", "bf16-mixed") for mp in (False, True)}


def test_mixed_precision_wins_for_params_autocast_for_ops() -> None:
    res = run_distributed(_grid, 2)[0]
    # Neither: fp32 everywhere.
    assert res[("32-true", False)] == {"weight": F32, "output": F32, "reduce": {F32}, "gather": {F32}, "grads": {F32}}
    # Autocast only: parameters gathered and reduced in fp32, matmuls run in bf16.
    assert res[("bf16-mixed", False)] == {
        "weight": F32,
        "output": BF16,
        "reduce": {F32},
        "gather": {F32},
        "grads": {F32},
    }
    # mixed_precision only: parameters gathered in bf16 (half the bytes), gradients reduced in fp32.
    assert res[("32-true", True)] == {"weight": BF16, "output": BF16, "reduce": {F32}, "gather": {BF16}, "grads": {F32}}
    # Both: mixed_precision decides parameter and reduction dtypes, whatever autocast does.
    assert res[("bf16-mixed", True)] == res[("32-true", True)]
