"""CPU offload: training with it equals training without it, bit for bit on CPU; a skipped copy shows.

Each launch (W=1, 2, 4) trains the same model with and without ``CPUOffload`` under several
settings (FULL_SHARD, ZeRO-2, NO_SHARD, bf16 mixed precision, gradient accumulation under
``no_sync``, clipping; HYBRID and reshard_after_forward=2 at W=4) and compares every loss and the final parameters and
optimizer state exactly; it also trains once with the host -> device copy dropped after the
first step (the fault must break parity), checks what the memory accounting says lives on the
host, and saves / loads checkpoints across offload and no offload.
"""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import shardline
import shardline.checkpoint as ckpt
from shardline.engine import offload as offload_module
from shardline.engine import transfer_stats
from shardline.errors import ConfigurationError
from shardline.testing import run_distributed
from tests.models import ParityModel, batch, local_slice, loss_fn

STEPS = 3
BF16 = torch.bfloat16

# name -> (strategy, mixed precision, micro-batches, clip, hybrid)
SETTINGS: dict[str, tuple[str, bool, int, float | None, bool]] = {
    "full_shard": ("full_shard", False, 1, None, False),
    "zero2_accumulate_clip": ("shard_grad_op", False, 2, 0.05, False),
    "bf16_accumulate": ("full_shard", True, 2, None, False),
    "no_shard": ("no_shard", False, 1, 0.05, False),
}
HYBRID = {"hybrid_accumulate_clip": ("hybrid_shard", False, 2, 0.05, True)}
# "STRATEGY@N": reshard_after_forward=N (backward gathers the post-forward piece over N ranks).
PARTIAL = {"partial_reshard": ("full_shard@2", False, 1, None, False)}


def _build(world: int, strategy: str, mixed: bool, hybrid: bool, offload: bool) -> ParityModel:
    torch.manual_seed(0)
    model = ParityModel()
    strategy, _, reshard = strategy.partition("@")
    kwargs: dict[str, Any] = {"strategy": strategy, "reshard_after_forward": int(reshard) if reshard else None}
    if mixed:
        kwargs["mixed_precision"] = shardline.MixedPrecision(param_dtype=BF16, reduce_dtype=torch.float32)
    if hybrid:
        kwargs["mesh"] = shardline.hybrid_mesh(replicate_size=2, shard_size=world // 2)
    if offload:
        kwargs["offload"] = shardline.CPUOffload()
    for block in model.blocks:
        shardline.fully_shard(block, **kwargs)
    return shardline.fully_shard(model, **kwargs)


def _train(
    model: ParityModel,
    rank: int,
    world: int,
    micro: int,
    clip: float | None,
    hybrid: bool = False,
    steps: int = STEPS,
    optimizer: torch.optim.Optimizer | None = None,
) -> tuple[list[float], torch.optim.Optimizer]:
    optimizer = optimizer or torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        tokens, targets = batch(step)
        tokens, targets = local_slice(tokens, rank, world), local_slice(targets, rank, world)
        total = torch.zeros(())
        for i, (x, y) in enumerate(zip(tokens.chunk(micro), targets.chunk(micro), strict=True)):
            last = i == micro - 1
            with model.no_sync(reduce_scatter=hybrid) if not last else contextlib.nullcontext():
                loss = loss_fn(model(x), y) / micro
                loss.backward()
            total += loss.detach()
        if clip is not None:
            model.clip_grad_norm_(clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(total)
        losses.append(float(total) / world)
    return losses, optimizer


def _snapshot(model: ParityModel, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """This rank's shards and optimizer state, by name (host copies)."""
    out = {f"param.{n}": p.detach().cpu().clone() for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                out[f"state.{names[id(p)]}.{key}"] = value.detach().cpu().clone()
    return out


def _differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


def _skip_copies_after(calls: int) -> None:
    """The fault: after ``calls`` host -> device copies, each one is dropped (its target keeps what it had)."""
    original = offload_module.HostCopies.to_device
    seen = [0]

    def dropping(self: offload_module.HostCopies, host: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        seen[0] += 1
        if seen[0] <= calls:
            return original(self, host, out)
        return out if out is not None else torch.empty(host.shape, dtype=host.dtype, device=self.device)

    offload_module.HostCopies.to_device = dropping  # type: ignore[method-assign]


def parity_ranks(rank: int, world: int, settings: dict[str, tuple[str, bool, int, float | None, bool]]) -> dict:
    """Per setting: losses without and with offload, and which tensors differ at the end; then the fault."""
    out: dict[str, Any] = {}
    for name, (strategy, mixed, micro, clip, hybrid) in settings.items():
        runs = []
        for offload in (False, True):
            model = _build(world, strategy, mixed, hybrid, offload)
            losses, optimizer = _train(model, rank, world, micro, clip, hybrid)
            runs.append((losses, _snapshot(model, optimizer), model, optimizer))
        (plain_losses, plain, _, _), (off_losses, off, model, optimizer) = runs
        stats = shardline.memory_stats(model, optimizer=optimizer)
        copies = _one_backward_accounting(model, optimizer, rank, world)
        plain_stats = shardline.memory_stats(runs[0][2], optimizer=runs[0][3])
        out[name] = {
            "plain": plain_losses,
            "offload": off_losses,
            "differ": _differences(plain, off),
            "host_params": stats.host_params,
            "sharded_params": stats.sharded_params,
            "host_grads": stats.host_grads,
            "host_state": stats.host_optimizer_state,
            "optimizer_state": stats.optimizer_state,
            "plain_host": plain_stats.host_total,
            "device_total": stats.device_total,
            "plain_device_total": plain_stats.device_total,
            **copies,
            "master_on_host": all(
                g.master.device.type == "cpu" for u in shardline.engine.subtree_units(model) for g in u.groups
            ),
        }
    # The injected fault: the first step's copies happen, every later one is dropped.
    strategy, mixed, micro, clip, hybrid = next(iter(settings.values()))
    copies = _count_first_step_copies(rank, world, strategy, mixed, micro, clip, hybrid)
    _skip_copies_after(copies)
    faulty = _build(world, strategy, mixed, hybrid, True)
    out["fault"] = _train(faulty, rank, world, micro, clip, hybrid)[0]
    return out


def _one_backward_accounting(
    model: ParityModel, optimizer: torch.optim.Optimizer, rank: int, world: int
) -> dict[str, int]:
    """Copies one forward + backward makes, against what it communicates, and where its gradients are."""
    before = copy.copy(transfer_stats(model))
    tokens, targets = batch(99)
    with shardline.count_collectives(model) as counter:
        loss_fn(model(local_slice(tokens, rank, world)), local_slice(targets, rank, world)).backward()
    after = transfer_stats(model)
    stats = shardline.memory_stats(model, optimizer=optimizer)
    optimizer.zero_grad(set_to_none=True)
    return {
        "h2d": after.host_to_device - before.host_to_device,
        # gathers of the flat shard (over the shard group); a partial reshard's backward gathers the
        # post-forward piece, already on the device, over a smaller group
        "shard_gathers": sum(r.group_size == model.shard_unit.mesh.shard_size for r in counter.select("all_gather")),
        "all_gathers": counter.count("all_gather"),
        "d2h_bytes": after.device_to_host_bytes - before.device_to_host_bytes,
        "trainable_shard_bytes": sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad),
        "grads_host": stats.host_grads,
        "grads": stats.sharded_grads,
    }


def _count_first_step_copies(
    rank: int, world: int, strategy: str, mixed: bool, micro: int, clip: float | None, hybrid: bool
) -> int:
    model = _build(world, strategy, mixed, hybrid, True)
    _train(model, rank, world, micro, clip, hybrid, steps=1)
    return transfer_stats(model).host_to_device


def _launch(world: int, settings: dict[str, tuple[str, bool, int, float | None, bool]]) -> dict:
    return run_distributed(parity_ranks, world, args=(settings,), timeout=150)[0]


def _check(result: dict, settings: dict[str, tuple[str, bool, int, float | None, bool]], world: int) -> None:
    for name in settings:
        r = result[name]
        assert r["offload"] == r["plain"], f"{name}: losses differ with offload: {r['offload']} vs {r['plain']}"
        assert r["differ"] == [], f"{name}: parameters / optimizer state differ with offload: {r['differ']}"
        assert r["master_on_host"], name
        # What lives where: every sharded byte of the offloaded model is on the host, none of the other's.
        assert r["host_params"] == r["sharded_params"] > 0, name
        assert r["host_state"] == r["optimizer_state"] > 0, name
        assert r["plain_host"] == 0, name
        assert r["device_total"] < r["plain_device_total"], name
        assert r["grads_host"] == r["grads"] > 0, name
        # One host -> device copy per all-gather (W=1 gathers without a collective: one per unit and pass),
        # and every trainable shard's gradient comes back to the host once.
        if world > 1 and not name.startswith("no_shard"):
            assert r["h2d"] == r["shard_gathers"] > 0, name
            assert (r["all_gathers"] > r["shard_gathers"]) == name.startswith("partial"), name
        else:
            assert r["h2d"] > 0, name
        assert r["d2h_bytes"] == r["trainable_shard_bytes"] > 0, name
    plain, fault = result[next(iter(settings))]["plain"], result["fault"]
    assert fault[0] == plain[0], "the first step's copies were made"
    assert fault[1] != plain[1], f"a dropped host -> device copy must break parity: {fault} vs {plain}"


@pytest.mark.parametrize("world", [1, 2])
def test_offload_parity_bit_identical(world: int) -> None:
    _check(_launch(world, SETTINGS), SETTINGS, world)


def test_offload_parity_bit_identical_w4_hybrid_partial_reshard() -> None:
    settings = {"full_shard": SETTINGS["full_shard"], **HYBRID, **PARTIAL}
    _check(_launch(4, settings), settings, 4)


def checkpoint_ranks(rank: int, world: int, root: str) -> dict[str, list[str]]:
    """Save with offload, load without (and the reverse): the loaded state equals the saved one exactly."""
    out = {}
    for name, save_offloaded in (("offload_to_plain", True), ("plain_to_offload", False)):
        path = str(Path(root) / name)
        model = _build(world, "full_shard", False, False, save_offloaded)
        _, optimizer = _train(model, rank, world, 1, None, steps=2)
        ckpt.save(path, model=model, optimizer=optimizer, step=2)
        saved = _snapshot(model, optimizer)
        other = _build(world, "full_shard", False, False, not save_offloaded)
        torch.manual_seed(7)
        _, other_optimizer = _train(other, rank, world, 1, None, steps=1)  # different state, to be overwritten
        ckpt.load(path, model=other, optimizer=other_optimizer)
        out[name] = _differences(saved, _snapshot(other, other_optimizer))
        # and training goes on identically from the loaded state
        losses = [_train(m, rank, world, 1, None, steps=1)[0] for m in (model, other)]
        if losses[0] != losses[1]:
            out[name].append(f"losses after load: {losses}")
    return out


def test_checkpoint_saved_with_offload_loads_without_and_back(tmp_path: Path) -> None:
    result = run_distributed(checkpoint_ranks, 2, args=(str(tmp_path),), timeout=150)
    for per_rank in result:
        assert per_rank == {"offload_to_plain": [], "plain_to_offload": []}


def test_offload_arguments_refused_with_reason() -> None:
    model = torch.nn.Linear(3, 3)
    with pytest.raises(ConfigurationError, match=r"offload must be a shardline\.CPUOffload"):
        shardline.fully_shard(model, offload=True)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=r"not supported with strategy shard_opt.*ZeRO-1"):
        shardline.fully_shard(model, strategy="shard_opt", offload=shardline.CPUOffload())
