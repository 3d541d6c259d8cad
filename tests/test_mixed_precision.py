"""bf16 compute with fp32 master shards: matches a one-process run with the same casts; dtypes are respected."""

from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist

import shardline
from shardline.testing import run_distributed
from tests.models import Block, ParityModel, batch, local_slice, loss_fn, max_rel_err

BF16, FP32 = torch.bfloat16, torch.float32
STEPS = 3


def _cast_inputs(_module, args):
    return tuple(a.to(BF16) if torch.is_tensor(a) and a.is_floating_point() else a for a in args)


def _reference_step(master: ParityModel, tokens: torch.Tensor, targets: torch.Tensor) -> float:
    """One step with the casts the engine makes: bf16 params, buffers and block inputs; fp32 grads on fp32 master."""
    low = copy.deepcopy(master)
    for p in low.parameters():
        p.data = p.data.to(BF16)
    low.pos_scale = low.pos_scale.to(BF16)  # buffer_dtype
    for block in low.blocks:
        block.register_forward_pre_hook(_cast_inputs)
    loss = loss_fn(low(tokens), targets)
    loss.backward()
    for p, q in zip(master.parameters(), low.parameters(), strict=True):
        p.grad = None if q.grad is None else q.grad.to(FP32)
    return loss.item()


def _run(rank: int, world_size: int, strategy: str, reduce_dtype: torch.dtype | None) -> dict:
    torch.manual_seed(0)
    master = ParityModel()
    torch.manual_seed(0)
    mp = shardline.MixedPrecision(param_dtype=BF16, reduce_dtype=reduce_dtype, buffer_dtype=BF16)
    model = shardline.wrap(ParityModel(), shardline.layer_policy(Block), strategy=strategy, mixed_precision=mp)
    ref_opt = torch.optim.AdamW(master.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    seen = {}
    model.blocks[0].fc1.register_forward_hook(
        lambda m, args, out: seen.update(weight=m.weight.dtype, input=args[0].dtype, output=out.dtype)
    )
    assert model.pos_scale.dtype == BF16, "buffer_dtype must apply to buffers"

    losses, ref_losses = [], []
    for step in range(STEPS):
        tokens, targets = batch(step)
        ref_losses.append(_reference_step(master, tokens, targets))
        ref_opt.step()
        ref_opt.zero_grad()
        with shardline.count_collectives(model) as counter:
            loss = loss_fn(model(local_slice(tokens, rank, world_size)), local_slice(targets, rank, world_size))
            loss.backward()
        assert all(p.dtype == FP32 for p in model.parameters()), "master shards must stay fp32"
        assert all(p.grad.dtype == FP32 for p in model.parameters() if p.grad is not None), "shard grads fp32"
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total, op=dist.ReduceOp.AVG)
        losses.append(total.item())

    full = shardline.full_state_dict(model)
    assert full["pos_scale"].dtype == FP32, "full state dicts give buffers back in their original dtype"
    expected = master.state_dict()
    errs = {k: max_rel_err(full[k], expected[k]) for k in expected if k != "pos_scale"}
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "errs": errs,
        "seen": {k: str(v) for k, v in seen.items()},
        "records": [(r.kind.value, str(r.dtype), r.bytes, r.unit) for r in counter.records],
        "grad_numel": _padded_grad_numel(master, world_size if strategy != "no_shard" else 1),
    }


def _padded_grad_numel(reference: torch.nn.Module, world: int) -> dict[str, int]:
    """Per-rank gradient elements of each unit: each trainable parameter's torch.chunk rows, padded."""

    def padded(p: torch.Tensor) -> int:
        rows = p.shape[0] if p.dim() else 1
        return math.ceil(rows / world) * (p.numel() // rows)

    out = {
        f"blocks.{i}": sum(padded(p) for p in block.parameters() if p.requires_grad)
        for i, block in enumerate(reference.blocks)
    }
    out["<root>"] = sum(
        padded(p) for name, p in reference.named_parameters() if not name.startswith("blocks.") and p.requires_grad
    )
    return out


def _grid(rank: int, world_size: int) -> dict:
    out = {
        ("full_shard", "fp32"): _run(rank, world_size, "full_shard", FP32),
        ("full_shard", "bf16"): _run(rank, world_size, "full_shard", None),
    }
    if world_size == 2:
        out[("no_shard", "fp32")] = _run(rank, world_size, "no_shard", FP32)
    return out


def test_bf16_matches_reference_with_same_casts() -> None:
    for world_size in (1, 2):
        results = run_distributed(_grid, world_size)
        for (strategy, reduce), res in results[0].items():
            for got, want in zip(res["losses"], res["ref_losses"], strict=True):
                assert abs(got - want) <= 1e-2 * abs(want), (strategy, reduce, res["losses"], res["ref_losses"])
            worst = max(res["errs"], key=res["errs"].get)
            assert res["errs"][worst] <= 1e-2, f"{strategy}/{reduce}: {worst} off by {res['errs'][worst]:.2e}"
            # Compute really happens in bf16.
            assert res["seen"] == {"weight": "torch.bfloat16", "input": "torch.bfloat16", "output": "torch.bfloat16"}
            if world_size == 1:
                assert res["records"] == []
                continue
            reduce_dtype = "torch.float32" if reduce == "fp32" else "torch.bfloat16"
            size = 4 if reduce == "fp32" else 2
            grad_kinds = {"reduce_scatter", "all_reduce"}
            reductions = [r for r in res["records"] if r[0] in grad_kinds]
            assert len(reductions) == 3
            for kind, dtype, nbytes, unit in reductions:
                assert dtype == reduce_dtype, f"{strategy}: {kind} of {unit} in {dtype}, expected {reduce_dtype}"
                per_rank = res["grad_numel"][unit]
                assert nbytes == (world_size if kind == "reduce_scatter" else 1) * per_rank * size
            gathers = [r for r in res["records"] if r[0] == "all_gather"]
            if strategy == "full_shard":  # parameters travel in bf16: half the bytes
                assert len(gathers) == 4, gathers  # 3 units in forward, blocks.0 again in backward
                assert all(dtype == "torch.bfloat16" for _, dtype, _, _ in gathers), gathers
            else:
                assert gathers == []
