"""The autograd graphs of real fine-tuning, sharded, equal one process: LoRA on frozen weights and friends.

Every case of the engine's post-backward rule is in one model (tests/finetune_models.py):
frozen weights that backward still needs (LoRA base layers, made their own all-frozen units; a
frozen LayerNorm weight used elementwise, its own unit), an all-frozen block on the gradient
path, a block used twice, a block whose output the loss ignores, a frozen embedding (the first
unit's input needs no gradient), a frozen teacher sharded separately and run under ``no_grad``
in the same step, and a ``no_grad`` forward of the model itself between its forward and
backward. A freed storage reaching a kernel would crash a rank; the harness reports that as a
failed test (ranks are child processes).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import shardline
from shardline.testing import GradientFault, run_distributed
from tests.finetune_models import (
    BATCH,
    SEQ,
    FineTuneNet,
    FrozenBlock,
    LoraBlock,
    batch,
    forward_terms,
    lora_blocks,
    loss_fn,
    padded_grad_bytes,
    rows,
)
from tests.models import chain_terms, grad_errors
from tests.numerics import (
    Reorder,
    assert_caught,
    assert_reordered,
    assert_trajectories,
    assert_trajectory,
    injecting,
    trajectory_ratio,
)
from tests.transports import TRANSPORTS, check_transports, counted, new_count, through, transports_for

pytestmark = pytest.mark.numerics  # run again under another CPU kernel set by .ci/run


STEPS = 3
STRATEGIES = ("full_shard", "shard_grad_op", "no_shard")


def _shard(model: FineTuneNet, strategy: str) -> FineTuneNet:
    for block in lora_blocks(model):
        shardline.fully_shard(block.q.base, strategy=strategy)  # all frozen: gathered for backward, never reduced
        shardline.fully_shard(block.norm, strategy=strategy)  # frozen weight used elementwise, trainable bias
    return shardline.wrap(model, shardline.layer_policy(LoraBlock, FrozenBlock), strategy=strategy)


def _make(seed: int, base_dtype: torch.dtype) -> FineTuneNet:
    torch.manual_seed(seed)
    return FineTuneNet(base_dtype)


def _optimizer(model: torch.nn.Module, base_dtype: torch.dtype) -> torch.optim.Optimizer:
    """AdamW; SGD with momentum for the bf16 base.

    Averaging gradients across ranks adds them in another order than one process does (~1e-7
    relative). In the bf16-base model Adam's per-element normalization amplifies that to ~4e-5 on
    small parameters within three steps (measured for NO_SHARD at W=4, which shards nothing), so
    that variant is checked with an optimizer that passes rounding differences on unamplified
    (see ``tests.numerics``: Adam's trajectories have no a priori bound).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if base_dtype == torch.bfloat16:
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2)


def _reference_step(
    reference: FineTuneNet,
    teacher: FineTuneNet,
    tokens: torch.Tensor,
    targets: torch.Tensor,
    world_size: int,
    base_dtype: torch.dtype,
) -> float:
    """One process on the global batch; for the bf16 base, as the mean of the ranks' gradients.

    Data parallelism backpropagates each rank's loss unscaled and averages the reduced gradients
    afterwards. Scaling the loss by 1/W instead (the whole-batch mean) puts the factor inside the
    bf16 layers, where it changes rounding unless W is a power of two: at W=3 the gradients differ
    by ~6e-3 in one process, without shardline. So the bf16 reference backpropagates the ranks'
    slices unscaled, one after another, then divides; fp32 uses the whole batch at once.
    """
    parts = world_size if base_dtype == torch.bfloat16 else 1
    total = 0.0
    for r in range(parts):
        x, y = rows(tokens, r, parts), rows(targets, r, parts)
        with torch.no_grad():
            teacher_logits, _ = teacher(x)
        logits, _ = reference(x)
        loss = loss_fn(logits, y, teacher_logits)
        loss.backward()
        total += loss.item() / parts
    if parts > 1:
        for p in reference.parameters():
            if p.grad is not None:
                p.grad /= parts
    return total


_REFERENCES: dict[tuple[int, torch.dtype], dict] = {}


def _reference(world_size: int, base_dtype: torch.dtype) -> dict:
    """One process on the global batches, trained once per launch and base dtype.

    It does not depend on the strategy or the transport, so every case of the grid compares with
    the same run: ``first`` (a copy after the first backward: its gradients), ``losses`` and ``final``.
    """
    key = (world_size, base_dtype)
    if key not in _REFERENCES:
        reference, teacher = _make(0, base_dtype), _make(7, base_dtype).requires_grad_(False)
        ref_opt = _optimizer(reference, base_dtype)
        losses, first = [], None
        for step in range(STEPS):
            tokens, targets = batch(step)
            losses.append(_reference_step(reference, teacher, tokens, targets, world_size, base_dtype))
            if step == 0:
                first = copy.deepcopy(reference)
                for kept, p in zip(first.parameters(), reference.parameters(), strict=True):
                    kept.grad = None if p.grad is None else p.grad.clone()
            ref_opt.step()
            ref_opt.zero_grad()
        _REFERENCES[key] = {"first": first, "losses": losses, "final": reference}
    return _REFERENCES[key]


def _run(
    rank: int,
    world_size: int,
    strategy: str,
    base_dtype: torch.dtype,
    fault: GradientFault | None = None,
    transport: str = "all_reduce",
) -> dict:
    """Train both models, the collectives through ``transport`` (``tests/transports.py``); with
    ``fault``, only the first step, through collectives with that bug."""
    ref = _reference(world_size, base_dtype)
    model, teacher = _shard(_make(0, base_dtype), strategy), _shard(_make(7, base_dtype), strategy)
    teacher.requires_grad_(False)
    opt = _optimizer(model, base_dtype)
    reached = [p for name, p in ref["first"].named_parameters() if p.requires_grad and not name.startswith("aux.")]
    grad_world = 1 if strategy == "no_shard" else world_size

    losses, grad_bytes = [], []
    comm = new_count()
    for step in range(STEPS):
        tokens, targets = batch(step)
        x, y = rows(tokens, rank, world_size), rows(targets, rank, world_size)
        broken = through(model, transport, fault)
        with (
            shardline.count_collectives(model) as counter,
            broken,
            through(teacher, transport),
            counted(model, teacher, into=comm),
        ):
            logits, _aux = model(x)
            with torch.no_grad():
                teacher_logits, _ = teacher(x)  # another sharded model, frozen, in the same step
                model(x)  # the same model under no_grad between its forward and backward
            loss = loss_fn(logits, y, teacher_logits)
            loss.backward()
        assert all(p.grad is None for p in model.aux.parameters()), "backward never reached aux"
        grad_bytes.append(counter.nbytes("reduce_scatter") + counter.nbytes("all_reduce", phase="backward"))
        if step == 0:  # the same parameters on both sides: the gradients differ by reordering alone
            first_grad_err = grad_errors(model, ref["first"])
            if fault:
                return {"grad_err": first_grad_err}
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total, op=dist.ReduceOp.AVG)
        losses.append(total.item())

    full = shardline.full_state_dict(model)
    expected = ref["final"].state_dict()
    frozen = {name for name, p in ref["final"].named_parameters() if not p.requires_grad}
    return {
        "losses": losses,
        "ref_losses": ref["losses"],
        "grad_err": first_grad_err,
        "trainable_ratio": trajectory_ratio(full, expected, skip=sorted(frozen)),
        "frozen_unchanged": all(torch.equal(full[k], expected[k]) for k in frozen),
        "dtypes": {k: str(full[k].dtype) for k in ("first.q.base.weight", "first.q.A.weight")},
        "grad_bytes": grad_bytes,
        "expected_grad_bytes": padded_grad_bytes(reached, grad_world) if world_size > 1 else 0,
        "comm": comm,
    }


def _grid(rank: int, world_size: int) -> dict:
    out: dict = {"ok": {}, "faults": {}}
    # The native transport at W=2 and 3: W=3 already has uneven shards and a rank whose shard of a
    # 2-row parameter is empty; W=4, the costliest launch on two cores, adds no new layout to it.
    for transport in transports_for(world_size) if world_size < 4 else TRANSPORTS[:1]:
        for strategy in STRATEGIES:
            for dtype in (torch.float32, torch.bfloat16):
                out["ok"][(strategy, str(dtype), transport)] = _run(rank, world_size, strategy, dtype, None, transport)
            for fault in GradientFault if world_size > 1 else ():  # the same check must see a broken reduction
                key = (strategy, fault.value, transport)
                out["faults"][key] = _run(rank, world_size, strategy, torch.float32, fault, transport)
    return out


def _rule(world_size: int, micro: int = 1) -> Reorder:
    """The fp32 chain of the trainable gradients. The bf16 base rounds activations to bf16 on both
    sides alike: its reference backpropagates each rank's slice as that rank does."""
    return Reorder(chain_terms(forward=forward_terms(), tokens=BATCH * SEQ, world_size=world_size, micro=micro))


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_fine_tuning_graphs_match_one_process(world_size: int) -> None:
    results = run_distributed(_grid, world_size, timeout=110)
    rule = _rule(world_size)
    for (strategy, fault, transport), res in results[0]["faults"].items():
        assert_caught(res["grad_err"], rule, f"{strategy}, W={world_size}, {transport} transport with {fault}")
    for (strategy, dtype, transport), res in results[0]["ok"].items():
        where = f"{strategy}, base {dtype}, W={world_size}, {transport} transport"
        if transport == "native":  # teacher and no_grad forwards included: the same calls either way
            for r in results:
                seen = {t: r["ok"][(strategy, dtype, t)]["comm"] for t in TRANSPORTS}
                check_transports(seen, where, native_expected=world_size > 1 and strategy != "no_shard")
        assert_reordered(res["grad_err"], rule, f"{where}: first step's trainable gradients")
        assert_trajectories(res["losses"], res["ref_losses"], where)
        assert_trajectory(res["trainable_ratio"], f"{where}: trainable parameters after {STEPS} steps")
        assert res["frozen_unchanged"], f"{where}: a frozen parameter changed"
        assert res["dtypes"] == {"first.q.base.weight": dtype, "first.q.A.weight": "torch.float32"}, res["dtypes"]
        if world_size == 1:
            assert res["losses"] == res["ref_losses"], f"{where}: one rank must be bitwise equal to the plain model"
        # Only the gradients of trainable parameters that backward reached travel (frozen: none, aux: none).
        assert res["grad_bytes"] == [res["expected_grad_bytes"]] * STEPS, (where, res["grad_bytes"])


def _accumulate(rank: int, world_size: int, fault: GradientFault | None = None) -> dict[str, dict]:
    """Two micro-batches per step (the first under no_sync); with ``fault``, only the first step."""
    out = {}
    for strategy in STRATEGIES:
        reference, model = _make(0, torch.float32), _shard(_make(0, torch.float32), strategy)
        ref_opt, opt = _optimizer(reference, torch.float32), _optimizer(model, torch.float32)
        for step in range(STEPS):
            tokens, targets = batch(step)
            logits, _ = reference(tokens)
            loss_fn(logits, targets).backward()
            xs, ys = rows(tokens, rank, world_size).chunk(2), rows(targets, rank, world_size).chunk(2)
            with model.no_sync():  # the first micro-batch keeps its gradients local
                logits, _ = model(xs[0])
                (loss_fn(logits, ys[0]) / 2).backward()
            with injecting(model, fault):
                logits, _ = model(xs[1])
                (loss_fn(logits, ys[1]) / 2).backward()
            if step == 0:
                grad_err = grad_errors(model, reference)
                if fault:
                    break
            ref_opt.step()
            ref_opt.zero_grad()
            opt.step()
            opt.zero_grad()
        if fault:
            out[strategy] = {"grad_err": grad_err}
            continue
        full, expected = shardline.full_state_dict(model), reference.state_dict()
        out[strategy] = {"grad_err": grad_err, "ratio": trajectory_ratio(full, expected)}
    return out


def _accumulate_with_faults(rank: int, world_size: int) -> dict:
    out = {"ok": _accumulate(rank, world_size)}
    out.update({fault.value: _accumulate(rank, world_size, fault) for fault in GradientFault})
    return out


def test_lora_with_gradient_accumulation_matches_one_process() -> None:
    results = run_distributed(_accumulate_with_faults, 2, timeout=110)[0]
    rule = _rule(2, micro=2)
    for strategy, res in results["ok"].items():
        where = f"{strategy}, two micro-batches (no_sync) per step"
        assert_reordered(res["grad_err"], rule, f"{where}: first step's gradients")
        assert_trajectory(res["ratio"], f"{where}: parameters after {STEPS} steps")
        for fault in GradientFault:
            assert_caught(results[fault.value][strategy]["grad_err"], rule, f"{where} with {fault.value}")
