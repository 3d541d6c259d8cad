"""Hybrid sharding on a 2-D (replicate, shard) mesh: equal to one process, and the collectives HSDP implies."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

import shardline
from shardline.engine import TorchCollectives, use_collectives
from shardline.testing import DelayedCollectives, GradientFault, run_distributed
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
from tests.transports import TRANSPORTS, check_transports, counted, new_count, through

pytestmark = pytest.mark.numerics  # run again under another CPU kernel set by .ci/run

FP32 = 4
GLOBAL_BATCH = 24  # divisible by 1-4 ranks times 2 micro-batches


def _train(
    rank: int,
    world_size: int,
    strategy: str,
    shape: tuple[int, int],
    micro: int,
    clip: bool,
    fault: GradientFault | None = None,
    transport: str = "all_reduce",
) -> dict:
    """Train both models, the collectives through ``transport`` (``tests/transports.py``); with
    ``fault``, only the first step, through collectives with that bug."""
    mesh = shardline.hybrid_mesh(replicate_size=shape[0], shard_size=shape[1])
    torch.manual_seed(0)
    reference = ParityModel()
    torch.manual_seed(0)
    model = shardline.wrap(ParityModel(), shardline.layer_policy(Block), strategy=strategy, mesh=mesh)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses, steps = [], []
    comm = new_count()
    for step in range(3):
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
        records = []
        for i, (t, y) in enumerate(pieces):
            deferring = i < micro - 1
            sync = model.no_sync(reduce_scatter=True) if deferring else torch.enable_grad()
            broken = through(model, transport, fault)
            with shardline.count_collectives(model) as counter, sync, broken, counted(model, into=comm):
                loss = loss_fn(model(t), y) / micro
                loss.backward()
            records.append([(r.kind.value, r.unit, r.bytes, r.group_size) for r in counter.records])
            total += loss.detach()
        with through(model, transport), counted(model, into=comm):
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
        dist.all_reduce(total, op=dist.ReduceOp.AVG)
        losses.append((total.item(), ref_loss.item()))
        steps.append(records)
    full = shardline.full_state_dict(model)
    expected = reference.state_dict()
    pieces = {k: v for k, v in model.state_dict().items() if isinstance(v, DTensor)}
    return {
        "losses": losses,
        "grad_err": first_grad_err,
        "param_ratio": trajectory_ratio(full, expected),
        "records": steps[-1],
        "placements": {tuple(v.placements) for v in pieces.values()},
        "mesh_shape": {tuple(v.device_mesh.shape) for v in pieces.values()},
        "comm": comm,
    }


CASES = [
    pytest.param(2, "hybrid_shard", (2, 1), 2, False, id="W2-2x1-accum2"),
    pytest.param(2, "hybrid_shard", (1, 2), 1, True, id="W2-1x2-clip"),
    pytest.param(4, "hybrid_shard", (2, 2), 1, True, id="W4-2x2-clip", marks=pytest.mark.compat),
    pytest.param(4, "hybrid_shard", (2, 2), 2, True, id="W4-2x2-accum2-clip"),
    pytest.param(4, "hybrid_shard_zero2", (2, 2), 2, False, id="W4-2x2-zero2-accum2"),
]


def _unit_sizes(shard: int) -> dict[str, tuple[int, int]]:
    """Per unit: (padded elements one rank sends in an all-gather, padded trainable elements), from the shapes."""

    def padded(shape: tuple[int, ...]) -> int:
        return math.ceil(shape[0] / shard) * math.prod(shape[1:])

    block = {
        (10,): 2,  # norm weight and bias
        (7, 10): 1,
        (7,): 1,
        (10, 7): 1,
        (2, 10): 1,
    }
    block_all = sum(padded(s) * n for s, n in block.items()) + padded((10,)) * 2  # fc2.bias, frozen_bias
    block_train = block_all - padded((10,))  # frozen_bias sends no gradient
    root = padded((13, 10)) + 2 * padded((10,))
    return {"blocks.0": (block_all, block_train), "blocks.1": (block_all, block_train), "<root>": (root, root)}


def _with_faults(rank: int, world_size: int, *args: object) -> dict:
    """Per transport: the case as it is, then its first step with each gradient fault injected."""
    out = {}
    for transport in TRANSPORTS:
        out[("ok", transport)] = _train(rank, world_size, *args, None, transport)
        for fault in GradientFault:
            out[(fault.value, transport)] = _train(rank, world_size, *args, fault, transport)
    return out


@pytest.mark.parametrize(("world_size", "strategy", "shape", "micro", "clip"), CASES)
def test_hybrid_matches_one_process(world_size: int, strategy: str, shape: tuple, micro: int, clip: bool) -> None:
    results = run_distributed(_with_faults, world_size, args=(strategy, shape, micro, clip), timeout=100)
    numel = sum(p.numel() for p in ParityModel().parameters())
    terms = chain_terms(forward=parity_forward_terms(), tokens=GLOBAL_BATCH * SEQ, world_size=world_size, micro=micro)
    rule = Reorder(terms + (numel if clip else 0))  # clipping scales by the norm: a sum over every element
    for transport in TRANSPORTS:
        res = results[0][("ok", transport)]
        where = f"{strategy} {shape} micro={micro} clip={clip}, {transport} transport"
        assert_reordered(res["grad_err"], rule, f"{where}: first step's gradients")
        assert_trajectories([got for got, _ in res["losses"]], [want for _, want in res["losses"]], where)
        assert_trajectory(res["param_ratio"], f"{where}: parameters after 3 AdamW steps")
        for fault in GradientFault:
            assert_caught(results[0][(fault.value, transport)]["grad_err"], rule, f"{where} with {fault.value}")
    for r in results:  # the same collectives and bytes either way; each transport's wire bytes
        seen = {t: r[("ok", t)]["comm"] for t in TRANSPORTS}
        check_transports(seen, f"{strategy} {shape} micro={micro}", native_expected=shape[1] > 1)
    res = results[0][("ok", "native")]  # the counts below hold for both: check_transports compared them
    # State-dict pieces are placed on the 2-D mesh: replicated across groups, Shard(0) inside.
    assert res["placements"] == {(Replicate(), Shard(0))}
    assert res["mesh_shape"] == {shape}

    replicas, shard = shape
    sizes = _unit_sizes(shard)
    *deferred, last = res["records"]
    for records in deferred:
        # Deferring the all-reduce: units still reduce-scatter inside the shard group (memory stays
        # sharded); nothing crosses replicas. A shard group of one has nothing to scatter: no collective.
        if shard > 1:
            assert sorted((u, b, n) for k, u, b, n in records if k == "reduce_scatter") == sorted(
                (u, shard * t * FP32, shard) for u, (_, t) in sizes.items()
            )
        assert [r for r in records if r[0] == "all_reduce"] == []
    # The last micro-batch: one reduce-scatter per unit in its shard group, one all-reduce per unit of
    # its reduced shard across the replicas -- carrying every micro-batch's sum.
    if shard > 1:
        assert sorted((u, b, n) for k, u, b, n in last if k == "reduce_scatter") == sorted(
            (u, shard * t * FP32, shard) for u, (_, t) in sizes.items()
        )
    expected_ar = sorted((u, t * FP32, replicas) for u, (_, t) in sizes.items()) if replicas > 1 else []
    if shard == 1 and replicas > 1:  # no shard to reduce-scatter: whole gradients, unpadded
        expected_ar = sorted((u, t * FP32, replicas) for u, (_, t) in _unit_sizes(1).items())
    assert sorted((u, b, n) for k, u, b, n in last if k == "all_reduce") == expected_ar
    gathers = [(u, b, n) for k, u, b, n in last if k == "all_gather"]
    assert all(n == shard for *_, n in gathers)
    if shard > 1:
        assert {(u, b) for u, b, _ in gathers} <= {(u, shard * a * FP32) for u, (a, _) in sizes.items()}


class _LoggedWork:
    def __init__(self, work: Any, log: list, event: tuple) -> None:
        self.work, self.log, self.event = work, log, event

    def wait(self, timeout: Any = None) -> bool:
        self.log.append(("wait", *self.event))
        return self.work.wait() if self.work is not None else True


class _Logged(TorchCollectives):
    """Logs when each gradient reduction is issued and when it is waited for."""

    def __init__(self, log: list) -> None:
        super().__init__()
        self.log = log
        self.issued: dict[str, int] = {}

    def _issue(self, kind: str, work: Any) -> Any:
        event = (kind, self.issued.setdefault(kind, 0))
        self.issued[kind] += 1
        self.log.append(("issue", *event))
        return _LoggedWork(work, self.log, event)

    def reduce_scatter(self, output: Any, input: Any, group: Any, *, op: Any, async_op: bool) -> Any:
        return self._issue("reduce_scatter", super().reduce_scatter(output, input, group, op=op, async_op=async_op))

    def all_reduce(self, tensor: Any, group: Any, *, op: Any, async_op: bool) -> Any:
        return self._issue("all_reduce", super().all_reduce(tensor, group, op=op, async_op=async_op))


def _overlap(rank: int, world_size: int) -> dict:
    """When the first reduce-scatter is waited for, relative to the next unit's backward; late collectives."""
    mesh = shardline.hybrid_mesh(shard_size=2)
    torch.manual_seed(0)
    model = shardline.wrap(ParityModel(), shardline.layer_policy(Block), strategy="hsdp", mesh=mesh)
    log: list = []

    # The gradient of blocks.0's output arrives when blocks.0's backward starts: compute after blocks.1's.
    def mark(_module: Any, _args: Any, out: torch.Tensor) -> None:
        out.register_hook(lambda _grad: log.append(("blocks.0",)))

    model.blocks[0].register_forward_hook(mark)
    tokens, targets = batch(0, GLOBAL_BATCH)
    x, y = local_slice(tokens, rank, world_size), local_slice(targets, rank, world_size)
    with use_collectives(model, _Logged(log)):
        loss_fn(model(x), y).backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    # Every collective lands late (NaN until waited): the chained all-reduce must wait for its reduce-scatter.
    with use_collectives(model, DelayedCollectives(0.002)):
        loss_fn(model(x), y).backward()
    late = [p.grad for p in model.parameters() if p.grad is not None]
    return {"log": log, "late_equal": all(torch.equal(a, b) for a, b in zip(grads, late, strict=True))}


def _checkpoint_roundtrip(rank: int, world_size: int) -> bool:
    """A hybrid model's state dict loads back into a hybrid model of another seed, exactly."""
    mesh = shardline.hybrid_mesh(shard_size=2)
    torch.manual_seed(0)
    a = shardline.wrap(ParityModel(), shardline.layer_policy(Block), strategy="hsdp", mesh=mesh)
    torch.manual_seed(1)
    b = shardline.wrap(ParityModel(), shardline.layer_policy(Block), strategy="hsdp", mesh=mesh)
    b.load_state_dict(a.state_dict())
    fa, fb = shardline.full_state_dict(a), shardline.full_state_dict(b)
    return all(torch.equal(fa[k], fb[k]) for k in fa)


def _roundtrip_and_overlap(rank: int, world_size: int) -> tuple[bool, dict]:
    return _checkpoint_roundtrip(rank, world_size), _overlap(rank, world_size)


def test_hybrid_state_dict_loads_into_hybrid_and_reductions_overlap_compute() -> None:
    results = run_distributed(_roundtrip_and_overlap, 4)
    assert all(loaded for loaded, _ in results)
    for _, res in results:
        log = res["log"]
        # blocks.1 reduce-scatters first; its all-reduce across replicas waits for it, blocks.0's backward does not.
        first_rs, rs_wait, first_ar = (
            ("issue", "reduce_scatter", 0),
            ("wait", "reduce_scatter", 0),
            ("issue", "all_reduce", 0),
        )
        assert log.index(first_rs) < log.index(("blocks.0",)) < log.index(rs_wait) < log.index(first_ar), log
        # Every reduce-scatter is waited for before its all-reduce is issued, and every collective is waited for.
        n = sum(1 for e in log if e[:2] == ("issue", "reduce_scatter"))
        assert n == 3
        for i in range(n):
            assert log.index(("wait", "reduce_scatter", i)) < log.index(("issue", "all_reduce", i)), log
            assert ("wait", "all_reduce", i) in log, log
        assert res["late_equal"], "late collectives changed the gradients"
