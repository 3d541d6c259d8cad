"""SHARD_OPT (ZeRO-1): full parameters on every rank, optimizer state sharded -- checked against one process,
ZeRO-1's communication formula and its memory formula."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardline
from shardline.engine import TorchCollectives, use_collectives
from shardline.testing import GradientFault, run_distributed
from tests.models import (
    SEQ,
    Block,
    ParityModel,
    batch,
    chain_terms,
    grad_errors,
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
    trajectory_ratio,
)
from tests.transports import TRANSPORTS, check_transports, counted, new_count, through, transports_for

pytestmark = pytest.mark.numerics  # run again under another CPU kernel set by .ci/run


FP32 = 4
GLOBAL_BATCH = 24


def _parity(
    rank: int,
    world_size: int,
    micro: int,
    clip: bool,
    fault: GradientFault | None = None,
    transport: str = "all_reduce",
) -> dict:
    """Train both models, the collectives through ``transport`` (``tests/transports.py``); with
    ``fault``, only the first step, through collectives with that bug."""
    torch.manual_seed(0)
    reference = ParityModel()
    torch.manual_seed(0)
    model = shardline.wrap(ParityModel(), shardline.layer_policy(Block), strategy="zero1")
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    comm = new_count()
    for step in range(4):
        tokens, targets = batch(step, GLOBAL_BATCH)
        ref_loss = loss_fn(reference(tokens), targets)
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05) if clip else None
        pieces = zip(
            local_slice(tokens, rank, world_size).chunk(micro),
            local_slice(targets, rank, world_size).chunk(micro),
            strict=True,
        )
        total = torch.zeros(())
        for i, (t, y) in enumerate(pieces):
            broken = through(model, transport, fault)
            with model.no_sync() if i < micro - 1 else torch.enable_grad(), broken, counted(model, into=comm):
                loss = loss_fn(model(t), y) / micro
                loss.backward()
            total += loss.detach()
        norm = model.clip_grad_norm_(0.05) if clip else None
        if step == 0:  # the same parameters on both sides: the gradients differ by reordering alone
            first_grad_err = grad_errors(model, reference)
            if clip:  # clipping divides a uniform gradient scale out of the gradients; the norm keeps it
                first_grad_err["total norm"] = abs(norm.item() - ref_norm.item()) / ref_norm.item()
            if fault:
                return {"grad_err": first_grad_err}
        ref_opt.step()
        ref_opt.zero_grad()
        opt.step()
        opt.zero_grad()
        torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.AVG)
        losses.append((total.item(), ref_loss.item()))
    full = shardline.full_state_dict(model)
    expected = reference.state_dict()
    # The optimizer sees this rank's rows only: its state is sharded like FULL_SHARD's.
    local = sum(p.numel() for p in model.parameters())
    return {
        "losses": losses,
        "grad_err": first_grad_err,
        "param_ratio": trajectory_ratio(full, expected),
        "bitwise": all(torch.equal(full[k], expected[k]) for k in expected),
        "local": local,
        "comm": comm,
    }


def _with_faults(rank: int, world_size: int, micro: int, clip: bool) -> dict:
    """Per transport: the case as it is, then (with several ranks) its first step with each fault injected."""
    out = {}
    for transport in transports_for(world_size):
        out[("ok", transport)] = _parity(rank, world_size, micro, clip, None, transport)
        for fault in GradientFault if world_size > 1 else ():
            out[(fault.value, transport)] = _parity(rank, world_size, micro, clip, fault, transport)
    return out


@pytest.mark.parametrize(
    ("world_size", "micro", "clip"), [(1, 1, False), pytest.param(2, 2, True, marks=pytest.mark.compat), (3, 1, True)]
)
def test_shard_opt_matches_one_process(world_size: int, micro: int, clip: bool) -> None:
    raw = run_distributed(_with_faults, world_size, args=(micro, clip), timeout=100)
    numel = sum(p.numel() for p in ParityModel().parameters())
    terms = chain_terms(forward=parity_forward_terms(), tokens=GLOBAL_BATCH * SEQ, world_size=world_size, micro=micro)
    rule = Reorder(terms + (numel if clip else 0))  # clipping scales by the norm: a sum over every element
    for transport in transports_for(world_size):
        results = [r[("ok", transport)] for r in raw]
        res = results[0]
        where = f"W={world_size} micro={micro} clip={clip}, {transport} transport"
        assert_reordered(res["grad_err"], rule, f"{where}: first step's gradients")
        assert_trajectories([got for got, _ in res["losses"]], [want for _, want in res["losses"]], where)
        assert_trajectory(res["param_ratio"], f"{where}: parameters after 4 AdamW steps")
        for fault in GradientFault if world_size > 1 else ():
            assert_caught(raw[0][(fault.value, transport)]["grad_err"], rule, f"{where} with {fault.value}")
        if world_size == 1:
            assert res["bitwise"], "W=1 SHARD_OPT must equal the plain model bit for bit"
        assert sum(r["local"] for r in results) == numel  # the optimizer's parameters are a partition
    for r in raw if world_size > 1 else ():  # ZeRO-1's all-reduces and row all-gathers: the same either way
        seen = {t: r[("ok", t)]["comm"] for t in TRANSPORTS}
        check_transports(seen, f"W={world_size} micro={micro} clip={clip}", native_expected=world_size > 1)


class Divisible(nn.Module):
    """Every dim 0 divisible by 2 and 4, so ZeRO's formulas hold without padding."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)) for _ in range(2))
        self.head = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _comm_and_memory(rank: int, world_size: int, native: bool) -> dict:
    torch.manual_seed(0)
    model = shardline.wrap(Divisible(), lambda m: isinstance(m, nn.Sequential), strategy="shard_opt")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(4, 16)

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)

    backend = TorchCollectives(gloo_all_reduce=not native)
    with use_collectives(model, backend):
        step()  # the first forward gathers nothing: every rank starts from the same parameters
        shardline.reset_comm_stats(model)
        with shardline.count_collectives(model) as counter:
            step()
        stats = shardline.comm_stats(model)
        with shardline.count_collectives(model) as evaluating, torch.no_grad():
            model(x)  # gathers the rows the last step updated
            model(x)  # nothing changed since: no collective
    memory = shardline.memory_stats(model, optimizer=opt)
    records = [(r.kind.value, r.unit, r.phase, r.bytes, r.group_size) for r in counter.records]
    return {
        "records": records,
        "wire": {k.value: v for k, v in stats.wire_bytes.items()},
        "eval": [(r.kind.value, r.phase) for r in evaluating.records],
        "memory": memory.as_dict(),
        "tensors": sum(1 for p in model.parameters() if p.requires_grad),
    }


@pytest.mark.parametrize("world_size", [2, 4])
def test_shard_opt_communication_and_memory_follow_zero1(world_size: int) -> None:
    res = run_distributed(_comm_and_memory, world_size, args=(True,))[0]
    fast = run_distributed(_comm_and_memory, world_size, args=(False,))[0]
    w = world_size
    # Independent of the engine: P elements per unit from the shapes (nothing padded at W=2 or 4).
    block = 16 * 32 + 32 + 32 * 16 + 16
    head = 16 * 8 + 8
    units = {"blocks.0": block, "blocks.1": block, "<root>": head}
    p_bytes = FP32 * sum(units.values())

    # One step: one all-reduce of each unit's gradients in backward, one all-gather of each unit's
    # updated rows in the next forward.
    reduces = sorted((u, b) for k, u, p, b, n in res["records"] if k == "all_reduce")
    gathers = sorted((u, b) for k, u, p, b, n in res["records"] if k == "all_gather")
    assert reduces == sorted((u, FP32 * n) for u, n in units.items())
    assert gathers == sorted((u, FP32 * n) for u, n in units.items())
    assert {k for k, *_ in res["records"]} == {"all_reduce", "all_gather"}
    assert all(n == w for *_, n in res["records"])
    assert [p for k, u, p, b, n in res["records"] if k == "all_gather"] == ["forward"] * 3
    # Per rank on the wire (ring algorithms): 2(W-1)/W x gradient bytes + (W-1)/W x parameter bytes.
    assert res["wire"]["all_reduce"] == pytest.approx(2 * (w - 1) / w * p_bytes, abs=len(units))
    assert res["wire"]["all_gather"] == pytest.approx((w - 1) / w * p_bytes, abs=len(units))
    # On gloo the all-gathers run as all-reduces: same logical bytes, all-reduce wire bytes.
    assert fast["records"] == res["records"]
    assert fast["wire"]["all_gather"] == pytest.approx(2 * (w - 1) / w * p_bytes, abs=len(units))
    # After the step, an evaluation forward gathers the updated rows once; a second one nothing.
    assert res["eval"] == [("all_gather", "forward")] * 3

    # Memory: parameters 4P and gradients 4P on every rank, AdamW state 8P/W (+ one step counter each).
    mem = res["memory"]
    assert mem["sharded_params"] == p_bytes
    assert mem["sharded_grads"] == p_bytes
    assert mem["optimizer_state"] == 2 * p_bytes // w + FP32 * res["tensors"]
    assert mem["unsharded_params"] == mem["comm_buffers"] == 0


def _padded_layout(rank: int, world_size: int) -> list[tuple[str, int]]:
    model = shardline.fully_shard(nn.Linear(5, 3), strategy="zero1")  # 3 rows over 4 ranks: uneven
    return [(name, p.numel()) for name, p in model.named_parameters()]


def test_shard_opt_rows_follow_torch_chunk() -> None:
    results = run_distributed(_padded_layout, 4)
    for rank, rows in enumerate(results):
        chunks = [t.numel() for t in torch.empty(3, 5).chunk(4)] + [0] * 4
        bias = [t.numel() for t in torch.empty(3).chunk(4)] + [0] * 4
        assert rows == [("weight", chunks[rank]), ("bias", bias[rank])], rank


def _init_paths(rank: int, world_size: int, strategy: str) -> dict:
    """Meta init and a full state dict scattered from rank 0 give every rank the reference's full parameters."""
    kwargs = {"mesh": shardline.hybrid_mesh(shard_size=2)} if strategy.startswith("hybrid") else {}
    torch.manual_seed(1234)
    reference = ParityModel()
    tokens, targets = batch(0, 24)
    want = loss_fn(reference(tokens), targets).item()

    with torch.device("meta"):
        meta = ParityModel()
    shardline.wrap(meta, shardline.layer_policy(Block), strategy=strategy, **kwargs)
    torch.manual_seed(1234)
    shardline.materialize(meta)

    torch.manual_seed(99)
    loaded = shardline.wrap(ParityModel(), shardline.layer_policy(Block), strategy=strategy, **kwargs)
    loaded(tokens[:2])  # gathered once with other values: a load must not leave stale copies behind
    shardline.load_full_state_dict(loaded, reference.state_dict() if rank == 0 else None, broadcast_from_rank0=True)
    # Every rank computes the loss of the whole global batch with its own full parameters.
    return {
        "meta": loss_fn(meta(tokens), targets).item(),
        "loaded": loss_fn(loaded(tokens), targets).item(),
        "want": want,
    }


@pytest.mark.parametrize(("strategy", "world_size"), [("shard_opt", 2), ("hybrid_shard", 4)])
def test_meta_init_and_rank0_loads_reach_every_replica(strategy: str, world_size: int) -> None:
    for rank, res in enumerate(run_distributed(_init_paths, world_size, args=(strategy,))):
        assert res["meta"] == res["want"], (rank, res)
        assert res["loaded"] == res["want"], (rank, res)
