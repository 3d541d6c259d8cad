"""Rank functions and a tiny Llama-like model for the 4-bit (NF4) base tests (tests/test_qlora.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardline
from shardline.engine import offload as offload_module
from shardline.engine import quantized as quantized_module
from shardline.engine.nf4 import to_nf4
from shardline.engine.registry import subtree_units
from shardline.errors import ShardingError

DIM, HIDDEN, VOCAB, RANK = 64, 72, 32, 4
SEQ, BATCH = 8, 8  # BATCH divisible by 1, 2 and 4
BLOCK, SCALER_BLOCK = 32, 8  # a scaler group is 256 elements: 16 per 64x64 weight, 18 per 64x72 one
STEPS = 4
LR = 1e-2


class QLoraLinear(nn.Module):
    """A frozen NF4 base weight plus a trainable low-rank adapter ``B(A(x))``."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.base = nn.Linear(d_in, d_out, bias=False)
        self.A = nn.Linear(d_in, RANK, bias=False)
        self.B = nn.Linear(RANK, d_out, bias=False)
        nn.init.normal_(self.B.weight, std=0.2)  # non-zero, so A gets gradients from the first step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.B(self.A(x))


class Block(nn.Module):
    """Pre-norm residual block: a LoRA projection, then an MLP whose down projection is NF4 without adapter."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.attn = QLoraLinear(DIM, DIM)
        self.up = QLoraLinear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(self.norm(x))
        return h + self.down(F.gelu(self.up(h)))


class TinyQLora(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def quantized_names() -> list[str]:
    return [f"blocks.{i}.{n}" for i in range(2) for n in ("attn.base.weight", "up.base.weight", "down.weight")]


def build() -> TinyQLora:
    """The same model on every call: NF4 base weights, frozen embedding/norms/head, trainable adapters."""
    torch.manual_seed(0)
    model = TinyQLora()
    for p in model.parameters():
        p.requires_grad_(False)
    for block in model.blocks:
        for lora in (block.attn, block.up):
            lora.A.weight.requires_grad_(True)
            lora.B.weight.requires_grad_(True)
            lora.base.weight = nn.Parameter(
                to_nf4(lora.base.weight, block_size=BLOCK, scaler_block_size=SCALER_BLOCK), requires_grad=False
            )
        block.down.weight = nn.Parameter(
            to_nf4(block.down.weight, block_size=BLOCK, scaler_block_size=SCALER_BLOCK), requires_grad=False
        )
    return model


def four_bit_bytes(model: nn.Module) -> int:
    """Bytes of every NF4 weight's packed codes, block scalers and group factors (from the format, not the engine)."""
    total = 0
    for name in quantized_names():
        numel = model.get_parameter(name).numel()
        total += numel // 2 + numel // BLOCK + (numel // (BLOCK * SCALER_BLOCK)) * 4
    return total


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))


def adapter_names(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


def full_adapter_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """A sharded model's adapter gradients, gathered to full tensors (a collective)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    saved = [p.detach().clone() for p in trainable]
    with torch.no_grad():
        for p in trainable:
            p.copy_(p.grad if p.grad is not None else torch.zeros_like(p))
    full = shardline.full_state_dict(model)
    with torch.no_grad():
        for p, value in zip(trainable, saved, strict=True):
            p.copy_(value)
    return {k: v for k, v in full.items() if ".A." in k or ".B." in k}


def train(model: nn.Module, group: dist.ProcessGroup | None) -> tuple[list[float], dict[str, list[float]]]:
    """``STEPS`` AdamW steps on this rank's slice of the batch: group-mean losses and first-step adapter grads."""
    x, y = batch()
    size = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if group is not None else 0
    per = BATCH // size
    x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
    losses: list[float] = []
    grads: dict[str, torch.Tensor] = {}
    for step in range(STEPS):
        loss = loss_of(model, x, y)
        loss.backward()
        value = loss.detach().clone()
        if group is not None:
            dist.all_reduce(value, group=group)
            value /= size
        losses.append(float(value))
        if step == 0:
            grads = (
                full_adapter_grads(model)
                if group is not None
                else {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
            )
        opt.step()
        opt.zero_grad()
    # Plain floats (exact for fp32 values): tensors would travel back to the test through file descriptors.
    return losses, {k: v.reshape(-1).tolist() for k, v in grads.items()}


def shard(model: nn.Module, group: dist.ProcessGroup, **kwargs: Any) -> nn.Module:
    return shardline.wrap(model, shardline.layer_policy(Block), mesh=group, **kwargs)


@contextlib.contextmanager
def dropped_factors() -> Iterator[None]:
    """Fault: while sharding, each weight's quantization factors are replaced by ones (its scale state lost)."""
    original = quantized_module._quantized_parts

    def faulty(tensor: Any, layout: Any, start: int, count: int) -> tuple[torch.Tensor, ...]:
        factor, scalers, data = original(tensor, layout, start, count)
        return torch.ones_like(factor), scalers, data

    quantized_module._quantized_parts = faulty  # type: ignore[assignment]
    try:
        yield
    finally:
        quantized_module._quantized_parts = original  # type: ignore[assignment]


@contextlib.contextmanager
def check_disabled() -> Iterator[None]:
    """Skip the pre-step check (to show what the parity comparison sees without it)."""
    original = quantized_module.QuantizedGroup.verify

    def skip(self: Any, **_kw: Any) -> list[str]:
        self.verified = True
        return []

    quantized_module.QuantizedGroup.verify = skip  # type: ignore[method-assign]
    try:
        yield
    finally:
        quantized_module.QuantizedGroup.verify = original  # type: ignore[method-assign]


def parity(rank: int, world: int) -> dict[str, Any]:
    """One launch of 4 ranks: sharded runs at W=1, 2, 4 (process groups), the plain reference, and the fault."""
    assert world == 4
    singles = [dist.new_group([r]) for r in range(4)]
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    groups = {1: singles[rank], 2: pairs[rank // 2], 4: dist.group.WORLD}
    out: dict[str, Any] = {}
    reference = build()
    out["reference"] = train(reference, None)
    out["four_bit_bytes"] = four_bit_bytes(reference)
    out["adapters"] = adapter_names(reference)
    for size, group in groups.items():
        model = shard(build(), group)
        if size == 4:
            registered = dict(model.named_parameters())
            out["shard_numels"] = {n: registered[n].numel() for n in quantized_names()}
            with shardline.count_collectives(model) as counter, torch.no_grad():
                model(batch()[0][:1])
            out["uint8_gathers"] = sum(
                1
                for r in counter.records
                if r.kind.value == "all_gather" and r.dtype == torch.uint8 and r.phase == "forward"
            )
        out[f"run{size}"] = train(model, group)
        if size == 4:
            stats = shardline.memory_stats(model)
            out["memory"] = {"quantized": stats.quantized_params, "unsharded": stats.unsharded_params}
    out.update(offload_runs(groups))
    # The fault: a weight's quantization factors dropped while sharding.
    with dropped_factors():
        faulty = shard(build(), dist.group.WORLD)
    try:
        loss_of(faulty, *batch())
        out["refused"] = None
    except ShardingError as exc:
        out["refused"] = str(exc)
    # A weight replaced after wrapping (as a re-initialization would), on rank 1 only.
    replaced = shard(build(), dist.group.WORLD)
    if rank == 1:
        layer = replaced.blocks[1].up.base
        layer._parameters["weight"] = nn.Parameter(torch.zeros(layer.weight.numel()), requires_grad=False)
    try:
        loss_of(replaced, *batch())
        out["replaced"] = None
    except ShardingError as exc:
        out["replaced"] = str(exc)
    with dropped_factors():
        unchecked = shard(build(), dist.group.WORLD)
    with check_disabled():
        out["faulty_run"] = train(unchecked, dist.group.WORLD)
    return out


# ---------------------------------------------------------------------- CPU offload of the 4-bit base
@contextlib.contextmanager
def dropped_quantized_copies() -> Iterator[None]:
    """Fault: after the first, host -> device copies of a 4-bit record are dropped.

    The staging buffer keeps what it had (as a reused device allocation would): every later gather
    sends the first record copied -- the first unit's weights -- instead of its own.
    """
    original = offload_module.HostCopies.to_device
    staged: dict[int, torch.Tensor] = {}

    def dropping(self: Any, host: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if host.dtype != torch.uint8:  # float shards are copied as usual
            return original(self, host, out)
        if host.numel() not in staged:
            staged[host.numel()] = original(self, host, out)
        return staged[host.numel()]

    offload_module.HostCopies.to_device = dropping  # type: ignore[method-assign]
    try:
        yield
    finally:
        offload_module.HostCopies.to_device = original  # type: ignore[method-assign]


def _offloaded_run(group: dist.ProcessGroup) -> tuple[tuple[list[float], dict[str, list[float]]], dict[str, Any]]:
    """Train the model sharded over ``group`` with CPUOffload; its losses and grads, memory and copies after."""
    model = shard(build(), group, offload=shardline.CPUOffload())
    result = train(model, group)
    stats = shardline.memory_stats(model)
    copies = shardline.engine.transfer_stats(model)
    records = [unit.quantized.local for unit in subtree_units(model) if unit.quantized is not None]
    return result, {
        "quantized": stats.quantized_params,
        "host_quantized": getattr(stats, "host_quantized", None),  # None: an engine without the field
        "host_total": stats.host_total,
        "device_total": stats.device_total,
        "total": stats.total,
        "host_params": stats.host_params,
        "sharded_params": stats.sharded_params,
        "record_devices": sorted({str(t.device) for t in records}),
        "record_bytes": sum(t.numel() for t in records),
        "h2d": copies.host_to_device,
        "h2d_bytes": copies.host_to_device_bytes,
    }


def offload_runs(groups: dict[int, dist.ProcessGroup]) -> dict[str, Any]:
    """NF4 + LoRA with CPUOffload at W=1 and W=2 (compared with ``run1``/``run2``), then W=2 with the copy dropped."""
    out: dict[str, Any] = {}
    for size in (1, 2):
        out[f"offload{size}"], out[f"offload{size}_memory"] = _offloaded_run(groups[size])
    with dropped_quantized_copies(), check_disabled():
        out["offload_dropped"], _ = _offloaded_run(groups[2])
    with dropped_quantized_copies():  # the pre-step check gathers through the same copy
        try:
            loss_of(shard(build(), groups[2], offload=shardline.CPUOffload()), *batch())
            out["offload_dropped_refused"] = None
        except ShardingError as exc:
            out["offload_dropped_refused"] = str(exc)
    return out
