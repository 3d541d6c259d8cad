"""bf16 compute with fp32 master shards: matches a one-process run with the same casts; dtypes are respected."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist

import shardline
from shardline.testing import GradientFault, run_distributed
from tests.models import Block, ParityModel, batch, grad_errors, local_slice, loss_fn
from tests.numerics import (
    Reorder,
    assert_caught,
    assert_reordered,
    assert_trajectory,
    close_ratio,
    condition,
    scale_ratio,
)
from tests.transports import TRANSPORTS, check_transports, counted, new_count, through, transports_for

pytestmark = pytest.mark.numerics  # run again under another CPU kernel set by .ci/run

BF16, FP32 = torch.bfloat16, torch.float32
STEPS = 3


def _cast_inputs(_module, args):
    return tuple(a.to(BF16) if torch.is_tensor(a) and a.is_floating_point() else a for a in args)


def _reference_step(
    master: ParityModel, tokens: torch.Tensor, targets: torch.Tensor, parts: int
) -> tuple[float, dict[str, float]]:
    """One step with the casts the engine makes; returns the loss and each gradient sum's condition.

    bf16 params, buffers and block inputs; fp32 grads on the fp32 master. Like data parallelism,
    it backpropagates each of ``parts`` slices of the batch on its own and averages their fp32
    gradients: bf16 kernels round a slice's activations and gradients differently from the whole
    batch's (by a few bf16 ulps, without shardline), so only this reference isolates what the
    engine does -- the average across ranks.
    """
    low = copy.deepcopy(master)
    for p in low.parameters():
        p.data = p.data.to(BF16)
    low.pos_scale = low.pos_scale.to(BF16)  # buffer_dtype
    for block in low.blocks:
        block.register_forward_pre_hook(_cast_inputs)
    partials: list[list[torch.Tensor | None]] = []
    loss = 0.0
    for r in range(parts):
        part = loss_fn(low(local_slice(tokens, r, parts)), local_slice(targets, r, parts))
        part.backward()
        loss += part.item() / parts
        partials.append([None if q.grad is None else q.grad.to(FP32) for q in low.parameters()])
        low.zero_grad()
    conditions = {}
    for i, (name, p) in enumerate(master.named_parameters()):
        grads = [g[i] for g in partials if g[i] is not None]
        p.grad = sum(grads) / parts if grads else None
        if grads:
            conditions[name] = condition(grads)
    return loss, conditions


def _optimizer(model: torch.nn.Module, reduce_dtype: torch.dtype | None) -> torch.optim.Optimizer:
    """AdamW; SGD with momentum where gradients are reduced in bf16.

    A bf16 reduction rounds each averaged gradient to bf16, a few ulps off the fp32 average. Adam
    divides each element by its own magnitude, so on near-zero elements that becomes an update
    off by up to the learning rate: no bound follows (``tests.numerics``). SGD passes the
    rounding on unamplified.
    """
    if reduce_dtype is None:
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _run(
    rank: int,
    world_size: int,
    strategy: str,
    reduce_dtype: torch.dtype | None,
    fault: GradientFault | None = None,
    transport: str = "all_reduce",
) -> dict:
    """Train both models, the collectives through ``transport`` (``tests/transports.py``); with
    ``fault``, only the first step, through collectives with that bug."""
    torch.manual_seed(0)
    master = ParityModel()
    torch.manual_seed(0)
    mp = shardline.MixedPrecision(param_dtype=BF16, reduce_dtype=reduce_dtype, buffer_dtype=BF16)
    model = shardline.wrap(ParityModel(), shardline.layer_policy(Block), strategy=strategy, mixed_precision=mp)
    ref_opt, opt = _optimizer(master, reduce_dtype), _optimizer(model, reduce_dtype)

    seen = {}
    model.blocks[0].fc1.register_forward_hook(
        lambda m, args, out: seen.update(weight=m.weight.dtype, input=args[0].dtype, output=out.dtype)
    )
    assert model.pos_scale.dtype == BF16, "buffer_dtype must apply to buffers"

    losses, ref_losses = [], []
    comm = new_count()
    for step in range(STEPS):
        tokens, targets = batch(step)
        ref_loss, conditions = _reference_step(master, tokens, targets, world_size)
        ref_losses.append(ref_loss)
        with shardline.count_collectives(model) as counter, through(model, transport, fault), counted(model, into=comm):
            loss = loss_fn(model(local_slice(tokens, rank, world_size)), local_slice(targets, rank, world_size))
            loss.backward()
        assert all(p.dtype == FP32 for p in model.parameters()), "master shards must stay fp32"
        assert all(p.grad.dtype == FP32 for p in model.parameters() if p.grad is not None), "shard grads fp32"
        if step == 0:  # the same parameters on both sides: the gradients differ by reordering alone
            first_grad_err = grad_errors(model, master)
            if fault:
                return {"grad_err": first_grad_err}
            first_conditions = conditions
        ref_opt.step()
        ref_opt.zero_grad()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total, op=dist.ReduceOp.AVG)
        losses.append(total.item())

    full = shardline.full_state_dict(model)
    assert full["pos_scale"].dtype == FP32, "full state dicts give buffers back in their original dtype"
    expected = master.state_dict()
    # Computed in bf16: compared as bf16 values at the tensor's scale, though stored in fp32.
    ratios = {k: scale_ratio(full[k], expected[k], BF16) for k in expected if k != "pos_scale"}
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "grad_err": first_grad_err,
        "conditions": first_conditions,
        "ratios": ratios,
        "seen": {k: str(v) for k, v in seen.items()},
        "records": [(r.kind.value, str(r.dtype), r.bytes, r.unit) for r in counter.records],
        "grad_numel": _padded_grad_numel(master, world_size if strategy != "no_shard" else 1),
        "comm": comm,
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
    out = {}
    for transport in transports_for(world_size):
        out[("full_shard", "fp32", transport)] = _run(rank, world_size, "full_shard", FP32, None, transport)
        out[("full_shard", "bf16", transport)] = _run(rank, world_size, "full_shard", None, None, transport)
        if world_size == 2:
            out[("no_shard", "fp32", transport)] = _run(rank, world_size, "no_shard", FP32, None, transport)
            for fault in GradientFault:  # the same check must see a broken gradient reduction
                for reduce, dtype in (("fp32", FP32), ("bf16", None)):
                    key = ("full_shard", reduce, transport, fault.value)
                    out[key] = _run(rank, world_size, "full_shard", dtype, fault, transport)
    return out


def _rule(world_size: int, reduce: str) -> Reorder:
    """The engine's part: averaging the ranks' gradients in the reduce dtype (``tests.numerics``).

    The reference sums the ``world_size`` fp32 partials and divides; the engine sums them in the
    reduce dtype, and divides in it: ``world_size`` roundings of that dtype at most.
    """
    if reduce == "fp32":
        return Reorder(world_size)
    return Reorder(world_size, low_terms=world_size, low_dtype=BF16)


def test_bf16_matches_reference_with_same_casts() -> None:
    for world_size in (1, 2):
        results = run_distributed(_grid, world_size)
        for key in list(results[0]):
            if len(key) == 4:
                strategy, reduce, transport, fault = key
                rule = _rule(world_size, reduce)
                where = f"{strategy}/{reduce}, {transport} transport, with {fault}"
                assert_caught(results[0].pop(key)["grad_err"], rule, where)
        for (strategy, reduce, transport), res in results[0].items():
            where = f"{strategy}/{reduce} W={world_size}, {transport} transport"
            if transport == "native":  # bf16 gathers of odd sizes travel natively on gloo too
                for r in results:
                    seen = {t: r[(strategy, reduce, t)]["comm"] for t in TRANSPORTS}
                    check_transports(seen, where, native_expected=world_size > 1 and strategy != "no_shard")
            rule = _rule(world_size, reduce)
            assert_reordered(res["grad_err"], rule, f"{where}: first step's gradients", conditions=res["conditions"])
            losses = {
                f"step {i}": close_ratio(a, b, BF16)
                for i, (a, b) in enumerate(zip(res["losses"], res["ref_losses"], strict=True))
            }
            assert_trajectory(losses, f"{where}: loss (bf16 compute)")
            assert_trajectory(res["ratios"], f"{where}: parameters after {STEPS} steps (bf16 compute)")
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
