"""The CUDA/NCCL path on one GPU: correctness, memory, no host sync, checkpoints, bf16 mixed precision.

One rank under NCCL (``run_distributed(backend="nccl")`` selects ``cuda:0`` before the group
exists). The native collectives and the rank-major copy-out run here for real; at several ranks
they are covered on gloo by the parity grids through ``tests/transports.py`` (docs/gpu.md).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import shardline
from shardline.checkpoint import CheckpointManager, SaveRequest, load
from shardline.engine import subtree_units
from shardline.testing import run_distributed
from tests.models import BATCH, SEQ, Block, ParityModel, batch, chain_terms, grad_errors, loss_fn, parity_forward_terms
from tests.numerics import Reorder, assert_reordered, assert_trajectories, assert_trajectory, trajectory_ratio

CUDA_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}  # deterministic cuBLAS: the same kernels on both sides
STRATEGIES = ("full_shard", "shard_grad_op", "shard_opt", "no_shard")


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _parity(rank: int, world_size: int) -> dict:
    """Every strategy at W=1 on CUDA against the plain model on the same GPU."""
    torch.use_deterministic_algorithms(True)
    device = _device()
    out: dict[str, Any] = {"backend": str(dist.get_backend()), "device": str(device)}
    for strategy in STRATEGIES:
        torch.manual_seed(0)
        reference = ParityModel().to(device)
        torch.manual_seed(0)
        model = shardline.wrap(ParityModel().to(device), shardline.layer_policy(Block), strategy=strategy)
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses, ref_losses = [], []
        for step in range(3):  # W=1: the engine issues no collective (nothing to exchange)
            tokens, targets = (t.to(device) for t in batch(step))
            ref_loss = loss_fn(reference(tokens), targets)
            ref_loss.backward()
            loss = loss_fn(model(tokens), targets)
            loss.backward()
            norm, ref_norm = model.clip_grad_norm_(1.0), torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
            if step == 0:
                first = grad_errors(model, reference)
                first["total norm"] = abs(norm.item() - ref_norm.item()) / ref_norm.item()
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()
            losses.append(loss.item())
            ref_losses.append(ref_loss.item())
        full = shardline.full_state_dict(model)
        out[strategy] = {
            "grad_err": first,
            "losses": (losses, ref_losses),
            "ratio": trajectory_ratio({k: v.cpu() for k, v in full.items()}, reference.cpu().state_dict()),
            "devices": {str(u.device) for u in subtree_units(model)},
        }
    return out


def test_every_strategy_on_cuda_matches_the_plain_model() -> None:
    (res,) = run_distributed(_parity, 1, backend="nccl", env=CUDA_ENV, timeout=120)
    assert res["backend"] == "nccl"
    assert res["device"] == "cuda:0"
    numel = sum(p.numel() for p in ParityModel().parameters())
    rule = Reorder(chain_terms(forward=parity_forward_terms(), tokens=BATCH * SEQ, world_size=1) + numel)
    for strategy in STRATEGIES:
        got = res[strategy]
        where = f"{strategy} on {res['device']}"
        assert got["devices"] == {"cuda:0"}, got["devices"]
        assert_reordered(got["grad_err"], rule, f"{where}: first step's gradients (and the clipped norm)")
        assert_trajectories(*got["losses"], where)
        assert_trajectory(got["ratio"], f"{where}: parameters after 3 steps")


class _Wide(nn.Module):
    """Large parameters, tiny activations: what a unit holds shows in ``memory_allocated``."""

    def __init__(self, dim: int = 1024, n: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def _memory(rank: int, world_size: int) -> dict:
    device = _device()
    model = _Wide().to(device)
    unit_bytes = sum(p.numel() * p.element_size() for p in model.layers[0].parameters())
    shardline.wrap(
        model,
        lambda m: isinstance(m, nn.Linear),
        reshard_after_forward=True,
        forward_prefetch=False,
        backward_prefetch=None,
    )
    x = torch.randn(1, 1024, device=device)
    model(x).sum().backward()  # warm up: NCCL, the caching allocator, the order of units
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    after_unit: list[int] = []
    for layer in model.layers:  # registered after sharding: runs after the unit freed its parameters
        layer.register_forward_hook(lambda m, a, out: after_unit.append(torch.cuda.memory_allocated() - baseline))
    with torch.no_grad():
        out = model(x)
    del out
    torch.cuda.synchronize()
    end = torch.cuda.memory_allocated() - baseline
    loss = model(x).sum()
    loss.backward()
    del loss
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    after_backward = torch.cuda.memory_allocated() - baseline
    return {"unit_bytes": unit_bytes, "after_unit": after_unit, "end": end, "after_backward": after_backward}


def test_memory_returns_to_baseline_after_each_unit_reshards() -> None:
    (res,) = run_distributed(_memory, 1, backend="nccl", timeout=120)
    # One 1024x1024 fp32 unit is 4 MiB; what stays after its forward is activations of a few KiB.
    assert len(res["after_unit"]) == 4
    for i, held in enumerate(res["after_unit"]):
        assert held < res["unit_bytes"] // 16, f"unit {i} still holds {held} B after forward ({res})"
    assert res["end"] == 0, f"memory did not return to the baseline after a no_grad forward: {res['end']} B"
    assert res["after_backward"] == 0, f"gradients or buffers left after backward: {res['after_backward']} B"


def _no_sync(rank: int, world_size: int) -> dict:
    """A training step -- engine and trainer -- under ``set_sync_debug_mode("error")``."""
    device = _device()
    torch.manual_seed(0)
    model = shardline.wrap(ParityModel().to(device), shardline.layer_policy(Block))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    tokens, targets = (t.to(device) for t in batch(0))
    for _step in range(3):  # the first step learns the order; later ones prefetch
        torch.cuda.set_sync_debug_mode("error")
        try:
            loss = loss_fn(model(tokens), targets)
            loss.backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()

    from tests.train.test_host_sync import _trainer  # the trainer's own step, on this GPU

    with tempfile.TemporaryDirectory() as tmp:
        trainer = _trainer(tmp, rank)
        for step in range(2):
            torch.cuda.set_sync_debug_mode("error")
            try:
                trainer._train_step(step)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        trainer_device = str(trainer.device)
    return {"loss": loss.item(), "trainer_device": trainer_device}


def test_no_host_sync_in_forward_backward_and_step() -> None:
    (res,) = run_distributed(_no_sync, 1, backend="nccl", timeout=120)
    assert res["loss"] == res["loss"], "the step produced NaN"
    assert res["trainer_device"] == "cuda:0"


def _checkpoints(rank: int, world_size: int, directory: str) -> dict:
    device = _device()
    out: dict[str, Any] = {}
    for mode in ("sync", "async"):
        torch.manual_seed(0)
        model = shardline.wrap(_Wide(n=8).to(device), lambda m: isinstance(m, nn.Linear))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.randn(2, 1024, device=device)).sum().backward()
        opt.step()
        manager = CheckpointManager(Path(directory) / mode, async_save=mode == "async")
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        manager.save(SaveRequest(model=model, optimizer=opt, step=1))
        manager.wait()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        expected = {k: v.clone() for k, v in shardline.full_state_dict(model).items()}
        torch.manual_seed(1)
        fresh = shardline.wrap(_Wide(n=8).to(device), lambda m: isinstance(m, nn.Linear))
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
        load(manager.path_for(1), model=fresh, optimizer=fresh_opt)
        got = shardline.full_state_dict(fresh)
        state_bytes = sum(v.numel() * v.element_size() for v in expected.values())
        out[mode] = {
            "exact": all(torch.equal(got[k], expected[k]) for k in expected),
            "peak_extra_bytes": peak,
            "model_bytes": state_bytes,
        }
    return out


def test_sync_and_async_checkpoints_round_trip(record_property: Any) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        (res,) = run_distributed(_checkpoints, 1, args=(tmp,), backend="nccl", timeout=120)
    for mode, got in res.items():
        record_property(f"{mode}_checkpoint_peak_extra_bytes", got["peak_extra_bytes"])
        assert got["exact"], f"{mode} checkpoint did not round-trip exactly"
        # Saving stages shards to the CPU: the GPU holds at most about one more copy of the model.
        assert got["peak_extra_bytes"] <= got["model_bytes"], (mode, got)


def _bf16(rank: int, world_size: int) -> dict:
    device = _device()
    torch.manual_seed(0)
    mp = shardline.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = shardline.wrap(ParityModel().to(device), shardline.layer_policy(Block), mixed_precision=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    seen = {}
    model.blocks[0].fc1.register_forward_hook(lambda m, a, o: seen.update(weight=str(m.weight.dtype), out=str(o.dtype)))
    tokens, targets = (t.to(device) for t in batch(0))
    grads = set()
    for _ in range(8):  # the same batch: the loss must fall
        loss = loss_fn(model(tokens), targets)
        loss.backward()
        grads |= {str(p.grad.dtype) for p in model.parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "seen": seen, "master": {str(p.dtype) for p in model.parameters()}, "grads": grads}


def test_bf16_mixed_precision_on_cuda() -> None:
    (res,) = run_distributed(_bf16, 1, backend="nccl", timeout=120)
    assert res["seen"] == {"weight": "torch.bfloat16", "out": "torch.bfloat16"}, "compute runs in bf16"
    assert res["master"] == {"torch.float32"}, "master shards stay fp32"
    assert res["grads"] == {"torch.float32"}, "gradients land in the master dtype"
    assert all(v == v for v in res["losses"]), res["losses"]
    assert res["losses"][-1] < res["losses"][0], res["losses"]
