"""``torch.compile`` on sharded models: per block and whole model, in both orders, equal to eager shardline.

Each case trains a compiled sharded model and the same model sharded the same way but eager, on
the same data at W=2, and compares the first step's gradients (same parameters on both sides: the
kernels differ, so the sums differ in order only -- ``tests.numerics.Reorder``), then the losses
and parameters after a few AdamW steps (assert_close's defaults). Dynamo's counters show graph
breaks (none inside a compiled block) and recompilations (none after the first step).

Compiling is slow on CPU, so one launch runs every case; the block's graph is the same in most
cases, and inductor's cache makes the later compiles cheap.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch._dynamo
import torch._inductor.config
import torch.distributed as dist
from torch import nn

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
from tests.numerics import (
    Reorder,
    assert_caught,
    assert_reordered,
    assert_trajectories,
    assert_trajectory,
    close_ratio,
    max_rel_err,
    scale_ratio,
    trajectory_ratio,
)

# The grid compiles the block's graphs in each rank: about 45 s with inductor's cache warm, 90 s cold
# on 2 busy CPU cores (the first test pays for it in its fixture).
pytestmark = [pytest.mark.numerics, pytest.mark.slow, pytest.mark.compat, pytest.mark.timeout(360)]

if os.environ.get("ATEN_CPU_CAPABILITY", "").lower() == "default":
    # Inductor writes its own vectorized C++ for the machine it finds, apart from ATen's kernel
    # sets; forcing ATen's scalar set breaks that build in torch 2.13 ("'at::vec' has not been
    # declared"), with or without shardline. .ci/run's second pass under `default` skips here.
    pytest.skip(
        "inductor's C++ does not build under ATEN_CPU_CAPABILITY=default (torch 2.13: 'at::vec' has not been declared)",
        allow_module_level=True,
    )

WORLD = 2
STEPS = 5
COUNTERS = torch._dynamo.utils.counters


@dataclass(frozen=True)
class Case:
    """One way of combining sharding and compiling.

    Attributes:
        name: What the case shows.
        compile: ``"blocks"`` (each block) or ``"model"`` (the whole model).
        order: ``"shard_first"`` (``module.compile()`` after sharding), ``"compile_first"``
            (``module.compile()`` before), ``"wrapper_first"`` (``torch.compile(module)`` before,
            sharding the wrapped modules), ``"shard_wrapper"`` (``torch.compile(block)`` before,
            then ``fully_shard`` of each wrapper and of the model: torchtitan's order).
        strategy: The sharding strategy of every unit.
        checkpoint: Activation checkpointing of every block.
        bf16: Mixed precision: bf16 compute, fp32 gradient reduction and master weights.
    """

    name: str
    compile: str = "blocks"
    order: str = "shard_first"
    strategy: str = "full_shard"
    checkpoint: bool = False
    bf16: bool = False


CASES = [
    Case("full_shard, blocks compiled after sharding"),
    Case("full_shard, blocks compiled before sharding", order="compile_first"),
    Case(
        "shard_grad_op, torch.compile(block) sharded, checkpointing", "blocks", "wrapper_first", "shard_grad_op", True
    ),
    Case("full_shard, fully_shard(torch.compile(block))", order="shard_wrapper"),
    Case("full_shard, whole model compiled after sharding", compile="model"),
    Case("no_shard, torch.compile(model) sharded", compile="model", order="wrapper_first", strategy="no_shard"),
    Case(
        "hybrid_shard_zero2, model.compile() before sharding",
        compile="model",
        order="compile_first",
        strategy="hybrid_shard_zero2",
    ),
    Case("shard_opt", strategy="shard_opt"),
    Case("hybrid_shard", strategy="hybrid_shard"),
    Case("full_shard, bf16 mixed precision, checkpointing", checkpoint=True, bf16=True),
]


def _build(case: Case, *, compiled: bool) -> nn.Module:
    torch.manual_seed(0)
    model: nn.Module = ParityModel()
    if case.checkpoint:
        shardline.apply_activation_checkpointing(model, shardline.layer_policy(Block))
    compile_now = compiled and case.order != "shard_first"
    if compile_now and case.order == "wrapper_first" and case.compile == "model":
        model = torch.compile(model)
    elif compile_now:
        _compile(model, case)
    mesh = shardline.hybrid_mesh(replicate_size=WORLD, shard_size=1) if case.strategy.startswith("hybrid") else None
    mp = shardline.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if case.bf16 else None
    kwargs = {"strategy": case.strategy, "mesh": mesh, "mixed_precision": mp}
    if case.order == "shard_wrapper":  # the units are the compiled wrappers themselves
        for block in model.blocks:
            shardline.fully_shard(block, **kwargs)
        shardline.fully_shard(model, **kwargs)
    else:
        shardline.wrap(model, shardline.layer_policy(Block), **kwargs)
    if compiled and case.order == "shard_first":
        _compile(model, case)
    return model


def _compile(model: nn.Module, case: Case) -> None:
    if case.compile == "model":
        model.compile()
        return
    blocks = model.blocks
    for i, block in enumerate(blocks):
        if case.order in ("wrapper_first", "shard_wrapper"):
            blocks[i] = torch.compile(block)
        else:
            block.compile()


def _step(model: nn.Module, step: int, rank: int) -> torch.Tensor:
    tokens, targets = batch(step)
    loss = loss_fn(model(local_slice(tokens, rank, WORLD)), local_slice(targets, rank, WORLD))
    loss.backward()
    return loss


def _unwrapped(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """State dict keys without ``torch.compile``'s wrapper component."""
    return {k.replace("_orig_mod.", ""): v for k, v in state.items()}


def _global(loss: torch.Tensor) -> float:
    total = loss.detach().clone()
    dist.all_reduce(total, op=dist.ReduceOp.AVG)
    return total.item()


def _train(rank: int, case: Case) -> dict:
    """Train the eager and the compiled model side by side; count dynamo's work on the compiled one.

    In bf16, inductor keeps a fused chain's intermediates in fp32 unless told to round them to
    bf16 after every operation as eager does (``emulate_precision_casts``); with it, the two differ
    by the roundings of other kernels only.
    """
    with torch._inductor.config.patch(emulate_precision_casts=case.bf16):
        return _train_case(rank, case)


def _train_case(rank: int, case: Case) -> dict:
    torch._dynamo.reset()
    COUNTERS.clear()
    eager, compiled = _build(case, compiled=False), _build(case, compiled=True)
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-2, weight_decay=0.1)
    opt = torch.optim.AdamW(compiled.parameters(), lr=1e-2, weight_decay=0.1)
    eager_losses, losses = [], []
    for step in range(STEPS):
        eager_losses.append(_global(_step(eager, step, rank)))
        losses.append(_global(_step(compiled, step, rank)))
        if step == 0:
            expected, actual = full_grads(eager), _unwrapped(full_grads(compiled))
            grad_err = {k: max_rel_err(actual[k], expected[k]) for k in expected}
            grad_scale = {k: scale_ratio(actual[k], expected[k], torch.bfloat16) for k in expected}
            grads_bitwise = all(torch.equal(actual[k], expected[k]) for k in expected)
            frames_after_first = COUNTERS["frames"]["ok"]
        eager_opt.step()
        opt.step()
        eager_opt.zero_grad()
        opt.zero_grad()
    actual, expected = _unwrapped(shardline.full_state_dict(compiled)), shardline.full_state_dict(eager)
    return {
        "losses": losses,
        "eager_losses": eager_losses,
        "grad_err": grad_err,
        "grad_scale": grad_scale,
        "grads_bitwise": grads_bitwise,
        "param_ratio": trajectory_ratio(actual, expected),
        "param_scale": {k: scale_ratio(actual[k], expected[k], torch.bfloat16) for k in expected},
        "graphs": COUNTERS["stats"]["unique_graphs"],
        "frames_first_step": frames_after_first,
        "frames_later": COUNTERS["frames"]["ok"] - frames_after_first,
        # graph breaks dynamo recovered from, and frames it gave up on
        "graph_breaks": {**COUNTERS["graph_break"], **COUNTERS["unimplemented"]},
    }


def _faulty_first_step(rank: int, fault: GradientFault) -> dict[str, float]:
    """The first step of the compiled model through broken collectives, compared the same way."""
    case = CASES[0]
    torch._dynamo.reset()
    eager, compiled = _build(case, compiled=False), _build(case, compiled=True)
    _step(eager, 0, rank)
    with use_collectives(compiled, FaultyCollectives(fault)):
        _step(compiled, 0, rank)
    expected, actual = full_grads(eager), full_grads(compiled)
    return {k: max_rel_err(actual[k], expected[k]) for k in expected}


def _refusals(rank: int) -> dict[str, str]:
    """What the unsupported combinations raise: the error's type and text ("" when nothing was raised)."""
    out = {}
    blocks = Case("fullgraph blocks")
    torch._dynamo.reset()
    model = _build(blocks, compiled=False)
    for block in model.blocks:
        block.compile(fullgraph=True)  # a block holds no unit: one graph
    out["fullgraph_blocks"] = _raised(lambda: _step(model, 0, rank))
    torch._dynamo.reset()
    model = _build(blocks, compiled=False)
    model.compile(fullgraph=True)
    out["fullgraph_model"] = _raised(lambda: _step(model, 0, rank))
    torch._dynamo.reset()
    model = _build(blocks, compiled=True)
    tokens, targets = batch(0)
    loss = loss_fn(model(local_slice(tokens, rank, WORLD)), local_slice(targets, rank, WORLD))
    with torch._dynamo.compiled_autograd._enable(torch.compile):
        out["compiled_autograd"] = _raised(loss.backward)
    return out


def _raised(fn: Callable[[], object]) -> str:
    try:
        fn()
    except Exception as e:  # the test reads what was raised
        return f"{type(e).__name__}: {e}"
    return ""


def _grid(rank: int, world_size: int) -> dict:
    out: dict = {case.name: _train(rank, case) for case in CASES}
    for fault in GradientFault:
        out[fault.value] = _faulty_first_step(rank, fault)
    out["refusals"] = _refusals(rank)
    return out


@pytest.fixture(scope="module")
def results() -> dict:
    return run_distributed(_grid, WORLD, timeout=330)[0]


GRADS = Reorder(chain_terms(forward=parity_forward_terms(), tokens=BATCH * SEQ, world_size=WORLD))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_compiled_equals_eager(results: dict, case: Case) -> None:
    res = results[case.name]
    where = f"{case.name} (compiled vs eager, W={WORLD})"
    if case.bf16:  # computed in bf16: bf16's defaults at the tensor's scale (tests.numerics)
        # Before torch 2.13, inductor still rounds a bf16 chain unlike eager with emulate_precision_casts:
        # plain torch (no shardline) compiling this model's checkpointed bf16 blocks differs from eager by
        # 1.64x bf16's defaults in the first step's gradients under 2.11, 0.93x under 2.13 (2026-11-27).
        # There the bound is 4x those defaults; a missing or doubled reduction is off by far more.
        slack = 1.0 if torch.__version__ >= "2.13" else 4.0
        losses = {
            f"step {i}": close_ratio(a, b, torch.bfloat16)
            for i, (a, b) in enumerate(zip(res["losses"], res["eager_losses"], strict=True))
        }
        for ratios, what in [
            (res["grad_scale"], "first step's gradients"),
            (losses, "loss"),
            (res["param_scale"], f"parameters after {STEPS} AdamW steps"),
        ]:
            assert_trajectory({k: v / slack for k, v in ratios.items()}, f"{where}: {what} (bf16 compute, /{slack})")
        return
    assert_reordered(res["grad_err"], GRADS, f"{where}: first step's gradients")
    assert_trajectories(res["losses"], res["eager_losses"], where)
    assert_trajectory(res["param_ratio"], f"{where}: parameters after {STEPS} AdamW steps")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_no_graph_break_in_blocks_and_no_recompile(results: dict, case: Case) -> None:
    res = results[case.name]
    assert res["graphs"] >= 1, f"{case.name}: nothing was compiled"
    assert res["frames_later"] == 0, f"{case.name}: {res['frames_later']} frames compiled after the first step"
    breaks = res["graph_breaks"]
    if case.compile == "blocks":
        assert not breaks, f"{case.name}: graph breaks {breaks}"
    else:  # the whole model breaks where a unit's forward begins and ends: shardline's hooks run eagerly
        assert breaks, f"{case.name}: expected graph breaks at shardline's hooks"
        assert all("shardline" in reason for reason in breaks), f"{case.name}: graph breaks {breaks}"


def test_comparison_sees_a_broken_reduction(results: dict) -> None:
    for fault in GradientFault:
        assert_caught(results[fault.value], GRADS, f"compiled blocks with {fault.value}")


def test_unsupported_combinations_are_refused_naming_the_fix(results: dict) -> None:
    refusals = results["refusals"]
    assert refusals["fullgraph_blocks"] == "", "fullgraph=True on each block must work"
    assert "compile each sharded unit" in refusals["fullgraph_model"], refusals["fullgraph_model"]
    error = refusals["compiled_autograd"]
    assert error.startswith("ConfigurationError: compiled autograd is capturing a backward pass"), error
    assert "Run backward outside torch._dynamo.compiled_autograd" in error, error
