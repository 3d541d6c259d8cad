"""Units used the ways real models use them: twice per step, nested I/O, no tensor out, checkpointed, frozen."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

import shardline
from shardline.testing import GradientFault, run_distributed
from tests.models import (
    BATCH,
    BLOCK_TERMS,
    DIM,
    SEQ,
    VOCAB,
    Block,
    batch,
    chain_terms,
    grad_errors,
    local_slice,
    loss_fn,
)
from tests.numerics import (
    Reorder,
    assert_caught,
    assert_reordered,
    assert_trajectory,
    injecting,
    max_rel_err,
    trajectory_ratio,
)

pytestmark = pytest.mark.numerics  # run again under another CPU kernel set by .ci/run


# Fancy: the shared block twice, the dict block's projection over DIM, the head over DIM, softmax over VOCAB.
FANCY_RULE = Reorder(chain_terms(forward=2 * BLOCK_TERMS + DIM + DIM + VOCAB, tokens=BATCH * SEQ, world_size=2))
# Two blocks on 8 rows of DIM features, a loss averaging all 8 * DIM outputs; up to two backward passes.
TWO_BLOCKS_RULE = Reorder(chain_terms(forward=2 * BLOCK_TERMS, tokens=8 * DIM, world_size=2, micro=2))


class DictBlock(nn.Module):
    """Takes a tensor and a dict, returns nested containers with a non-grad tensor, a None and an int."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, extras: dict) -> dict:
        y = torch.tanh(self.proj(x)) * extras["scale"]
        return {"out": (y, (y > 0).long()), "aux": None, "count": extras["count"] + 1, "detached": y.detach()}


class Probe(nn.Module):
    """Returns nothing: records a statistic computed with its parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(DIM))
        self.last = None

    def forward(self, x: torch.Tensor) -> None:
        self.last = float((x * self.w).mean())


class Fancy(nn.Module):
    def __init__(self, use_checkpoint: bool = False) -> None:
        super().__init__()
        self.use_checkpoint = use_checkpoint
        self.emb = nn.Embedding(VOCAB, DIM)
        self.shared = Block()
        self.io = DictBlock()
        self.probe = Probe()
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for _ in range(2):  # the same unit twice per step
            x = checkpoint(self.shared, x, use_reentrant=False) if self.use_checkpoint else self.shared(x)
        out = self.io(x, {"scale": torch.tensor(0.5), "count": 1})
        assert out["count"] == 2
        assert out["aux"] is None
        assert not out["detached"].requires_grad
        y = out["out"][0]
        self.probe(y.detach())
        return self.head(y)


def _wrap(model: nn.Module, strategy: str) -> nn.Module:
    return shardline.wrap(model, shardline.layer_policy(Block, DictBlock, Probe), strategy=strategy)


def _parity(
    rank: int, world_size: int, strategy: str, use_checkpoint: bool, fault: GradientFault | None = None
) -> dict:
    """Train both models; with ``fault``, only the first step, through collectives with that bug."""
    torch.manual_seed(0)
    reference = Fancy(use_checkpoint)
    torch.manual_seed(0)
    model = _wrap(Fancy(use_checkpoint), strategy)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    units = shardline.engine.subtree_units(model)
    for step in range(3):
        tokens, targets = batch(step)
        loss_fn(reference(tokens), targets).backward()
        with injecting(model, fault):
            loss_fn(model(local_slice(tokens, rank, world_size)), local_slice(targets, rank, world_size)).backward()
        if step == 0:  # the same parameters on both sides: the gradients differ by reordering alone
            first_grad_err = grad_errors(model, reference)
            if fault:
                return {"grad_err": first_grad_err}
        ref_opt.step()
        ref_opt.zero_grad()
        assert not any(u.is_gathered for u in units), "every unit is freed at the end of backward"
        assert model.probe.w.grad is None, "a parameter used only outside autograd gets no gradient"
        # An evaluation forward without grad frees everything it gathered.
        with torch.no_grad():
            model(local_slice(tokens, rank, world_size))
        assert not any(u.is_gathered for u in units), "no_grad forward must not leave parameters gathered"
        # A forward whose backward never comes, right before the optimizer step: what it leaves
        # gathered must not be used by the next step's forward.
        model(local_slice(tokens, rank, world_size))
        opt.step()
        opt.zero_grad()
    full = shardline.full_state_dict(model)
    return {"grad_err": first_grad_err, "ratio": trajectory_ratio(full, reference.state_dict())}


STRATEGIES = ("full_shard", "shard_grad_op", "no_shard")


def _grid(rank: int, world_size: int) -> dict:
    out = {(s, c): _parity(rank, world_size, s, c) for s in STRATEGIES for c in (False, True)}
    for fault in GradientFault:  # the same check must see a broken gradient reduction
        out.update({(s, fault.value): _parity(rank, world_size, s, False, fault) for s in STRATEGIES})
    return out


def test_unusual_forwards_match_one_process() -> None:
    results = run_distributed(_grid, 2)[0]
    for fault in GradientFault:
        for strategy in STRATEGIES:
            assert_caught(results.pop((strategy, fault.value))["grad_err"], FANCY_RULE, f"{strategy}, {fault.value}")
    for (strategy, ckpt), res in results.items():
        where = f"{strategy} checkpoint={ckpt}"
        assert_reordered(res["grad_err"], FANCY_RULE, f"{where}: first step's gradients")
        assert_trajectory(res["ratio"], f"{where}: parameters after 3 AdamW steps")


def _two_backwards_and_freezing(rank: int, world_size: int, fault: GradientFault | None = None) -> dict:
    torch.manual_seed(0)
    reference = nn.Sequential(Block(), Block())
    torch.manual_seed(0)
    model = shardline.wrap(nn.Sequential(Block(), Block()), shardline.layer_policy(Block))
    x = torch.randn(8, DIM, generator=torch.Generator().manual_seed(3))
    mine = local_slice(x, rank, world_size)

    # Two losses, two backward passes, one optimizer step: gradients add up.
    (reference(x).pow(2).mean()).backward()
    (reference(x).sin().mean()).backward()
    with injecting(model, fault):
        model(mine).pow(2).mean().backward()
        model(mine).sin().mean().backward()
    errs = []
    for (name, ref_p), p in zip(reference.named_parameters(), model.parameters(), strict=True):
        if ref_p.grad is None:
            continue
        unit = model[int(name[0])].shard_unit
        sp = next(s for s in unit.params if s.sharded is p)
        rows = ref_p.grad.reshape(sp.layout.rows, -1)[sp.layout.row_start : sp.layout.row_start + sp.layout.local_rows]
        errs.append(max_rel_err(p.grad.reshape(rows.shape), rows))
    if fault:
        return _max_over_ranks(errs)

    # Freezing a block after sharding: no gradient, and no gradient bytes, for it.
    for p in model[0].parameters():
        p.requires_grad_(False)
        p.grad = None
    with shardline.count_collectives(model) as counter:
        model(mine).sum().backward()
    assert all(p.grad is None for p in model[0].parameters())
    assert all(p.grad is not None for p in model[1].parameters() if p.requires_grad)
    scatters = [r.unit for r in counter.records if r.kind.value == "reduce_scatter"]
    return {"err": _max_over_ranks(errs), "scatters": scatters}


def _max_over_ranks(errs: list[float]) -> float:
    total = torch.tensor(max(errs), dtype=torch.float64)
    dist.all_reduce(total, op=dist.ReduceOp.MAX)
    return total.item()


def _two_backwards_with_faults(rank: int, world_size: int) -> dict:
    out = {"ok": _two_backwards_and_freezing(rank, world_size)}
    out.update({f.value: _two_backwards_and_freezing(rank, world_size, f) for f in GradientFault})
    return out


def test_two_backward_passes_and_freezing_after_sharding() -> None:
    results = run_distributed(_two_backwards_with_faults, 2)[0]
    res = results["ok"]
    assert_reordered(res["err"], TWO_BLOCKS_RULE, "two backward passes: accumulated gradients")
    for fault in GradientFault:
        assert_caught(results[fault.value], TWO_BLOCKS_RULE, f"two backward passes with {fault.value}")
    assert res["scatters"] == ["1"], "only the trainable block reduces gradients"


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_modes_keep_accumulating_correctly(set_to_none: bool) -> None:
    run_distributed(_zero_grad, 2, args=(set_to_none,))


def _zero_grad(rank: int, world_size: int, set_to_none: bool) -> None:
    torch.manual_seed(0)
    model = shardline.wrap(nn.Sequential(Block(), Block()), shardline.layer_policy(Block))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.randn(4, DIM)
    model(x).sum().backward()
    first = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    opt.zero_grad(set_to_none=set_to_none)
    for p in model.parameters():
        assert (p.grad is None) if set_to_none or not p.requires_grad else torch.count_nonzero(p.grad) == 0
    model(x).sum().backward()
    second = [p.grad for p in model.parameters() if p.grad is not None]
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def _inference_first(rank: int, world_size: int, fault: GradientFault | None = None) -> dict:
    torch.manual_seed(0)
    reference = nn.Sequential(Block(), Block())
    torch.manual_seed(0)
    model = shardline.wrap(nn.Sequential(Block(), Block()), shardline.layer_policy(Block))
    x = torch.randn(8, DIM, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():  # an evaluation before any training: the first gathers happen here
        evaluated = model(local_slice(x, rank, world_size))
    reference(x).pow(2).mean().backward()
    with injecting(model, fault):
        model(local_slice(x, rank, world_size)).pow(2).mean().backward()
    full = {k: v.grad for k, v in reference.named_parameters() if v.grad is not None}
    errs = []
    for unit in shardline.engine.subtree_units(model):
        for sp in unit.params:
            if sp.sharded.grad is None:
                continue
            name = f"{unit.name}.{sp.fqn}" if unit.name else sp.fqn
            rows = full[name].reshape(sp.layout.rows, -1)[
                sp.layout.row_start : sp.layout.row_start + sp.layout.local_rows
            ]
            errs.append(max_rel_err(sp.sharded.grad.reshape(rows.shape), rows))
    return {"evaluated": tuple(evaluated.shape), "err": _max_over_ranks(errs)}


def _inference_first_with_faults(rank: int, world_size: int) -> dict:
    out = {"ok": _inference_first(rank, world_size)}
    out.update({f.value: _inference_first(rank, world_size, f)["err"] for f in GradientFault})
    return out


def test_a_first_forward_under_inference_mode_does_not_poison_training() -> None:
    results = run_distributed(_inference_first_with_faults, 2)[0]
    res = results["ok"]
    assert res["evaluated"] == (4, DIM)
    assert_reordered(res["err"], TWO_BLOCKS_RULE, "training after an inference-mode forward: gradients")
    for fault in GradientFault:
        assert_caught(results[fault.value], TWO_BLOCKS_RULE, f"after an inference-mode forward, {fault.value}")
