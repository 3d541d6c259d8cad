"""fp16 compute with a loss scaler whose overflow verdict every rank shares.

Parity: ``MixedPrecision(param_dtype=float16)`` + :class:`shardline.ShardedGradScaler` at W=1, 2, 4
against one process that makes the same casts and scales with ``torch.amp.GradScaler``. Agreement:
an inf put into one rank's gradient shard makes every rank skip the step and back off the scale,
through exactly one counted all-reduce -- and the same checks fail once that all-reduce is removed.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import shardline
from shardline.engine.grad_scaler import PHASE, ShardedGradScaler
from shardline.errors import ConfigurationError
from shardline.testing import run_distributed
from tests.models import Block, ParityModel, batch, grad_errors, local_slice, loss_fn
from tests.numerics import Reorder, assert_reordered, assert_trajectory, close_ratio, condition, scale_ratio

FP16, FP32 = torch.float16, torch.float32
STEPS = 3
POLICY = shardline.LossScaling(init_scale=2.0**12, growth_interval=2)


def _cast_inputs(_module, args):
    return tuple(a.to(FP16) if torch.is_tensor(a) and a.is_floating_point() else a for a in args)


def _reference_step(
    master: ParityModel, scaler: torch.amp.GradScaler, tokens: torch.Tensor, targets: torch.Tensor, parts: int
) -> tuple[float, dict[str, float]]:
    """The engine's casts in one process: fp16 params, buffers and block inputs, loss times the scale.

    Each of ``parts`` slices is backpropagated on its own (as each rank does) and the fp32 copies
    of their scaled fp16 gradients averaged onto the fp32 master; ``scaler`` unscales them.
    """
    low = copy.deepcopy(master)
    for p in low.parameters():
        p.data = p.data.to(FP16)
    low.pos_scale = low.pos_scale.to(FP16)
    for block in low.blocks:
        block.register_forward_pre_hook(_cast_inputs)
    partials: list[list[torch.Tensor | None]] = []
    loss = 0.0
    for r in range(parts):
        part = loss_fn(low(local_slice(tokens, r, parts)), local_slice(targets, r, parts))
        scaler.scale(part).backward()
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


def _parity(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    master = ParityModel()
    torch.manual_seed(0)
    mp = shardline.MixedPrecision(param_dtype=FP16, buffer_dtype=FP16)
    model = shardline.wrap(ParityModel(), shardline.layer_policy(Block), strategy="full_shard", mixed_precision=mp)
    ref_opt = torch.optim.SGD(master.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=POLICY.init_scale, growth_interval=POLICY.growth_interval)
    scaler = ShardedGradScaler(model, policy=POLICY)
    seen: dict[str, str] = {}
    model.blocks[0].fc1.register_forward_hook(lambda m, args, out: seen.update(weight=str(m.weight.dtype)))
    losses, ref_losses, scales, ref_scales = [], [], [], []
    for step in range(STEPS):
        tokens, targets = batch(step)
        ref_loss, conditions = _reference_step(master, ref_scaler, tokens, targets, world_size)
        ref_scaler.unscale_(ref_opt)
        loss = loss_fn(model(local_slice(tokens, rank, world_size)), local_slice(targets, rank, world_size))
        scaler.scale(loss).backward()
        scaler.unscale_(opt)  # the true gradients from here (clipping would go here)
        if step == 0:  # the same parameters on both sides: the gradients differ by reordering alone
            first_grad_err, first_conditions = grad_errors(model, master), conditions
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        ref_opt.zero_grad()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        ref_losses.append(ref_loss)
        ref_scales.append(ref_scaler.get_scale())
        scales.append(scaler.get_scale())
        total = loss.detach().float().clone()
        dist.all_reduce(total, op=dist.ReduceOp.AVG)
        losses.append(total.item())
    full = shardline.full_state_dict(model)
    expected = master.state_dict()
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "scales": scales,
        "ref_scales": ref_scales,
        "grad_err": first_grad_err,
        "conditions": first_conditions,
        "ratios": {k: scale_ratio(full[k], expected[k], FP16) for k in expected if k != "pos_scale"},
        "seen": seen,
    }


@pytest.mark.numerics
def test_fp16_with_scaler_matches_reference_with_same_casts() -> None:
    for world_size in (1, 2, 4):
        res = run_distributed(_parity, world_size, timeout=90)[0]
        where = f"fp16 + ShardedGradScaler W={world_size}"
        # The engine averages the ranks' scaled fp16 gradients in fp16: world_size fp16 roundings on top of
        # the fp32 reordering. The scale is a power of two, so scaling and unscaling round nothing.
        rule = Reorder(world_size, low_terms=world_size, low_dtype=FP16)
        assert_reordered(res["grad_err"], rule, f"{where}: first step's gradients", conditions=res["conditions"])
        assert res["scales"] == res["ref_scales"], f"{where}: scale {res['scales']} vs torch's {res['ref_scales']}"
        assert res["scales"][-1] > POLICY.init_scale, "the scale must have grown (growth_interval=2)"
        losses = {
            f"step {i}": close_ratio(a, b, FP16)
            for i, (a, b) in enumerate(zip(res["losses"], res["ref_losses"], strict=True))
        }
        assert_trajectory(losses, f"{where}: loss (fp16 compute)")
        assert_trajectory(res["ratios"], f"{where}: parameters after {STEPS} steps (fp16 compute)")
        assert res["seen"] == {"weight": "torch.float16"}


def _overflow(rank: int, world_size: int, agree: bool) -> dict:
    """One step with an inf in the last rank's gradient shard only; ``agree=False`` removes the all-reduce."""
    if not agree:  # the injected fault: each rank keeps its own verdict
        ShardedGradScaler._agree = lambda self, found: None  # type: ignore[method-assign]
    torch.manual_seed(0)
    mp = shardline.MixedPrecision(param_dtype=FP16)
    mesh = shardline.hybrid_mesh(replicate_size=2, shard_size=world_size // 2) if world_size == 4 else None
    strategy = "hybrid_shard" if mesh is not None else "full_shard"
    model = shardline.wrap(
        ParityModel(), shardline.layer_policy(Block), strategy=strategy, mesh=mesh, mixed_precision=mp
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler(model, policy=POLICY)
    before = [p.detach().clone() for p in model.parameters()]
    tokens, targets = batch(0)
    scaler.scale(
        loss_fn(model(local_slice(tokens, rank, world_size)), local_slice(targets, rank, world_size))
    ).backward()
    if rank == world_size - 1:  # an overflow in this rank's shard alone
        grad = next(p.grad for p in model.parameters() if p.grad is not None and p.grad.numel())
        grad.view(-1)[0] = float("inf")
    with shardline.count_collectives(model) as counter:
        stepped = scaler.step(opt)
        scaler.update()
    return {
        "stepped": stepped,
        "unchanged": all(torch.equal(a, p.detach()) for a, p in zip(before, model.parameters(), strict=True)),
        "scale": scaler.get_scale(),
        "records": [(r.kind.value, r.phase, r.group_size, r.bytes) for r in counter.records],
    }


def _skip_problems(results: list[dict], world_size: int) -> list[str]:
    """What is wrong with an overflowed step: any rank that stepped, changed, or kept another scale."""
    problems = []
    for rank, r in enumerate(results):
        if r["stepped"] or not r["unchanged"]:
            problems.append(f"rank {rank} stepped (parameters unchanged: {r['unchanged']})")
        if r["scale"] != POLICY.init_scale * POLICY.backoff_factor:
            problems.append(f"rank {rank} scale is {r['scale']}, not backed off")
        expected = [("all_reduce", PHASE, world_size, 4)] if world_size > 1 else []
        if r["records"] != expected:
            problems.append(f"rank {rank} issued {r['records']}, expected {expected}")
    return problems


def test_overflow_on_one_rank_skips_the_step_on_every_rank() -> None:
    for world_size in (2, 4):  # 4: hybrid (2 replicas x 2-rank shards); the verdict spans the whole world
        assert _skip_problems(run_distributed(_overflow, world_size, args=(True,)), world_size) == []
        # The same checks see a scaler that does not agree: the clean ranks step, their scale stays.
        broken = _skip_problems(run_distributed(_overflow, world_size, args=(False,)), world_size)
        assert any("stepped" in p for p in broken), broken
        assert any("not backed off" in p for p in broken), broken


def test_loss_scaling_rejects_bad_values() -> None:
    with pytest.raises(ConfigurationError, match="backoff_factor must be between 0 and 1, got 2"):
        shardline.LossScaling(backoff_factor=2)
    with pytest.raises(ConfigurationError, match="growth_interval must be a positive integer, got 0"):
        shardline.LossScaling(growth_interval=0)
