"""Rank functions for the checkpoint tests (module level, so the harness can pickle them by name).

Tensors cross the process boundary as ``torch.save`` bytes (``pack``/``unpack``): a queue would
pass them through shared memory owned by ranks that have exited.
"""

from __future__ import annotations

import io
import os
import warnings
from typing import Any

import torch

import shardline
import shardline.checkpoint as ckpt
from shardline.checkpoint.faults.fault import KillAtPhase
from shardline.checkpoint.state.rng import capture_rng_state, restore_rng_state
from tests.models import Block, ParityModel, batch, local_slice, loss_fn

CONFIG = {"model": "parity", "lr": 0.01, "betas": [0.9, 0.95], "steps": 6}


def pack(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def unpack(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def build(strategy: str = "full_shard", *, seed: int = 0, mixed: bool = False, n_blocks: int = 2):
    torch.manual_seed(seed)
    model = ParityModel(n_blocks=n_blocks)
    mp = shardline.MixedPrecision(param_dtype=torch.bfloat16) if mixed else None
    shardline.wrap(model, shardline.layer_policy(Block), strategy=strategy, mixed_precision=mp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=CONFIG["lr"], betas=tuple(CONFIG["betas"]))
    return model, optimizer


def train_step(model, optimizer, step: int, rank: int, world: int) -> float:
    """One step on the global batch of ``step``; draws from the RNG so resume must restore it."""
    tokens, targets = batch(step)
    noise = 1.0 + 0.01 * torch.rand(())  # consumes torch's RNG: resume parity needs RNG restore
    loss = loss_fn(model(local_slice(tokens, rank, world)), local_slice(targets, rank, world)) * noise
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    total = loss.detach().clone()
    torch.distributed.all_reduce(total)
    return total.item()


def snapshot(model, optimizer) -> bytes:
    """Full model and optimizer state (rank 0 holds them), packed."""
    full = shardline.full_state_dict(model, rank0_only=True)
    optim = ckpt.optimizer_state_dict(model, optimizer, kind="full")
    return pack((full, optim))


def trainer_state(step: int) -> dict[str, Any]:
    return {"step": step, "data": {"epoch": 0, "position": step * 12}, "per_rank": {"rng": capture_rng_state()}}


def save_trained(
    rank: int, world: int, path: str, strategy: str, mixed: bool, kind: str, files_per_rank: int = 0
) -> tuple[str, bytes]:
    model, optimizer = build(strategy, mixed=mixed)
    for step in range(2):
        train_step(model, optimizer, step, rank, world)
    info = ckpt.save(
        path,
        model=model,
        optimizer=optimizer,
        state=trainer_state(2),
        step=2,
        config=CONFIG,
        kind=kind,
        files_per_rank=files_per_rank,
    )
    return info.manifest_hash, snapshot(model, optimizer)


def load_good_and_damaged(rank: int, world: int, good: str, damaged: str) -> tuple[bytes, tuple[str, str]]:
    """Load ``good`` (its snapshot), then try ``damaged`` (the error type and message)."""
    model, optimizer = build(seed=123)
    ckpt.load(good, model=model, optimizer=optimizer)
    taken = snapshot(model, optimizer)
    return taken, catch(ckpt.load, damaged, model=model, optimizer=optimizer)


def load_into(rank: int, world: int, path: str, strategy: str, verify: str) -> tuple[bytes, bytes]:
    model, optimizer = build(strategy, seed=123)
    state = ckpt.load(path, model=model, optimizer=optimizer, verify=verify)
    return pack(state), snapshot(model, optimizer)


def run_with_manager(
    rank: int, world: int, directory: str, steps: int, save_at: list[int], async_save: bool, files_per_rank: int = 0
) -> list[float]:
    """Train ``steps`` steps from scratch, saving through a manager at the listed steps; return the losses."""
    model, optimizer = build()
    losses = []
    with ckpt.CheckpointManager(directory, async_save=async_save, files_per_rank=files_per_rank) as manager:
        for step in range(steps):
            losses.append(train_step(model, optimizer, step, rank, world))
            if step + 1 in save_at:
                manager.save(
                    ckpt.SaveRequest(
                        step=step + 1,
                        model=model,
                        optimizer=optimizer,
                        state=trainer_state(step + 1),
                        config=CONFIG,
                        data_fingerprint="synthetic-batches-v1",
                    )
                )
    return losses


def resume_and_train(
    rank: int, world: int, directory: str, resume: str, steps: int
) -> tuple[int, list[float], str | None]:
    """Resume through a manager, restore the RNG, train up to ``steps``; return (start step, losses, parent)."""
    model, optimizer = build(seed=99)
    manager = ckpt.CheckpointManager(directory)
    state = manager.load(resume, model=model, optimizer=optimizer)
    restore_rng_state(state["per_rank"]["rng"])
    start = state["step"]
    losses = [train_step(model, optimizer, step, rank, world) for step in range(start, steps)]
    return start, losses, manager.parent_manifest_hash


def save_then_crash(rank: int, world: int, directory: str, phase: str, victim: int) -> None:
    """Save step 1, then save step 2 with a fault observer: rank ``victim`` dies at ``phase`` of that save."""
    model, optimizer = build()
    manager = ckpt.CheckpointManager(directory)
    train_step(model, optimizer, 0, rank, world)
    manager.save(ckpt.SaveRequest(step=1, model=model, optimizer=optimizer, state=trainer_state(1)))
    train_step(model, optimizer, 1, rank, world)
    manager.observer = KillAtPhase(phase, ranks={victim})
    manager.save(ckpt.SaveRequest(step=2, model=model, optimizer=optimizer, state=trainer_state(2)))


def resume_step(rank: int, world: int, directory: str) -> tuple[int | None, bytes]:
    model, optimizer = build(seed=5)
    manager = ckpt.CheckpointManager(directory)
    state = manager.load("auto", model=model, optimizer=optimizer, verify="full")
    return (state or {}).get("step"), snapshot(model, optimizer)


def catch(fn, *args, **kwargs) -> tuple[str, str]:
    try:
        fn(*args, **kwargs)
    except shardline.ShardlineError as e:
        return type(e).__name__, str(e)
    return "no error", ""


def bad_inputs(rank: int, world: int, root: str, good: str) -> dict[str, tuple[str, str]]:
    """Every misuse, on every rank; returns (error type, message) per case."""
    model, _ = build()
    out: dict[str, tuple[str, str]] = {}
    blocker = os.path.join(root, "a-file")
    if rank == 0:
        with open(blocker, "w") as f:
            f.write("not a directory")
    torch.distributed.barrier()
    out["unwritable"] = catch(ckpt.save, os.path.join(blocker, "step-1"), model=model, step=1)
    out["exists"] = catch(ckpt.save, good, model=model, step=1)
    out["unsafe_state"] = catch(ckpt.save, os.path.join(root, "step-9"), model=model, step=9, state={"obj": object()})
    out["unsafe_left_nothing"] = ("listing", ",".join(sorted(os.listdir(root))))
    empty = os.path.join(root, "empty")
    if rank == 0:
        os.makedirs(empty, exist_ok=True)
    torch.distributed.barrier()
    out["not_a_checkpoint"] = catch(ckpt.load, empty, model=model)
    other, other_optim = build(n_blocks=3)
    out["wrong_model"] = catch(ckpt.load, good, model=other, optimizer=other_optim)
    wide = ParityModel()
    wide.blocks[0].fc1 = torch.nn.Linear(10, 9)
    wide.blocks[0].fc2 = torch.nn.Linear(9, 10)
    shardline.wrap(wide, shardline.layer_policy(Block))
    out["wrong_shapes"] = catch(ckpt.load, good, model=wide)
    manager = ckpt.CheckpointManager(os.path.join(root, "run"))
    out["resume_missing"] = catch(manager.resolve, os.path.join(root, "nope"))
    out["resume_empty"] = catch(manager.resolve, empty)
    out["resume_auto_none"] = ("value", str(manager.resolve("auto")))
    plain = os.path.join(root, "plain")
    torch.distributed.checkpoint.save({"model": ckpt.model_state_dict(model)}, checkpoint_id=plain)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ckpt.load(plain, model=model, verify="none")
    out["plain_warning"] = ("warnings", " | ".join(f"{w.category.__name__}: {w.message}" for w in caught))
    out["plain_full_verify"] = catch(ckpt.load, plain, model=model)
    out["plain_sizes_verify"] = catch(ckpt.load, plain, model=model, verify="sizes")
    out["old_level_name"] = catch(ckpt.load, good, model=model, verify="manifest")
    return out


def state_dict_kinds(rank: int, world: int) -> dict[str, bool]:
    """Round trip each state-dict kind in memory; returns check name -> passed."""
    from torch.distributed.tensor import DTensor

    model, optimizer = build()
    for step in range(2):
        train_step(model, optimizer, step, rank, world)
    reference = unpack(snapshot(model, optimizer))  # a collective: every rank takes part
    results: dict[str, bool] = {}
    sharded = ckpt.model_state_dict(model)
    results["sharded_are_dtensors"] = isinstance(sharded["blocks.0.fc1.weight"], DTensor)
    results["sharded_shares_memory"] = (
        sharded["blocks.0.fc1.weight"].to_local().data_ptr() == model.blocks[0].fc1.weight.data_ptr()
    )
    saved = {kind: ckpt.model_state_dict(model, kind=kind) for kind in ("sharded", "local", "full")}
    saved = {k: ({n: v.clone() if not isinstance(v, DTensor) else v for n, v in sd.items()}) for k, sd in saved.items()}
    osaved = {kind: ckpt.optimizer_state_dict(model, optimizer, kind=kind) for kind in ("sharded", "local", "full")}
    osaved = {k: _deep_clone(v) for k, v in osaved.items()}
    results["optim_keyed_by_fqn"] = "blocks.0.fc1.weight" in osaved["sharded"]["state"]
    results["full_only_on_rank0"] = (rank == 0) == bool(saved["full"])
    for kind in ("sharded", "local", "full"):
        fresh, fresh_opt = build(seed=7)
        # take a fresh sharded view of the saved pieces (DTensors above alias the trained model)
        sd = saved[kind] if kind != "sharded" else {k: _clone_piece(v) for k, v in saved[kind].items()}
        ckpt.load_model_state_dict(fresh, sd if (kind != "full" or rank == 0) else None, kind=kind)
        ckpt.load_optimizer_state_dict(
            fresh, fresh_opt, osaved[kind] if (kind != "full" or rank == 0) else None, kind=kind
        )
        got = unpack(snapshot(fresh, fresh_opt))
        if rank == 0:
            results[f"{kind}_roundtrip"] = _same(reference, got)
    return results


def _clone_piece(v):
    from torch.distributed.tensor import DTensor

    if isinstance(v, DTensor):
        return DTensor.from_local(v.to_local().clone(), v.device_mesh, v.placements, shape=v.shape, stride=v.stride())
    return v.clone()


def _deep_clone(obj):
    if isinstance(obj, dict):
        return {k: _deep_clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_deep_clone(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return _clone_piece(obj)
    return obj


def _same(a, b) -> bool:
    (full_a, optim_a), (full_b, optim_b) = a, b
    if full_a.keys() != full_b.keys() or not all(torch.equal(full_a[k], full_b[k]) for k in full_a):
        return False
    if optim_a["param_groups"] != optim_b["param_groups"] or optim_a["state"].keys() != optim_b["state"].keys():
        return False
    return all(
        torch.equal(optim_a["state"][f][n], optim_b["state"][f][n])
        for f in optim_a["state"]
        for n in optim_a["state"][f]
    )


def save_llama(rank: int, world: int, root: str) -> dict[str, bytes]:
    """A tiny random Llama, sharded per decoder layer, saved untied and tied; returns full state dicts."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = {}
    for tie in (False, True):
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=tie,
        )
        model = LlamaForCausalLM(config)
        shardline.wrap(model, shardline.layer_policy("transformers.models.llama.modeling_llama.LlamaDecoderLayer"))
        path = os.path.join(root, f"tied-{tie}")
        ckpt.save(path, model=model, state={"step": 1}, step=1)  # the model's config is recorded by itself
        out[path] = pack(shardline.full_state_dict(model, rank0_only=True))
    return out


def load_failing_on_one_rank(rank: int, world: int, path: str) -> tuple[str, str]:
    """Load a checkpoint while the trainer state does not decode on rank 1 alone (after DCP's agreed read)."""
    import importlib

    load_module = importlib.import_module("shardline.checkpoint.lifecycle.load")  # the package's `load` is the function
    model, optimizer = build(seed=123)
    if rank == 1:

        def undecodable(data: bytes) -> Any:
            raise ValueError("this rank cannot decode its trainer state")

        load_module.decode_state = undecodable
    return catch(ckpt.load, path, model=model, optimizer=optimizer)


def lightning_append_fails_on_rank0(rank: int, world: int, directory: str) -> tuple[str, str]:
    """Save with the Lightning strategy's recording step while rank 0's ledger append fails."""
    from pathlib import Path

    from shardline.lightning.strategy import record_commit

    model, optimizer = build()
    path = Path(directory) / "epoch=0-step=1.ckpt"
    info = ckpt.save(path, model=model, optimizer=optimizer, step=1)
    if rank == 0:

        def disk_full(self: Any, **kwargs: Any) -> None:
            raise OSError(28, "No space left on device", str(self.path))

        ckpt.Ledger.append = disk_full
    return catch(record_commit, path, info)


def hf_append_fails_on_rank0(rank: int, world: int, directory: str) -> tuple[str, str]:
    """The Hugging Face Trainer's recording step while rank 0's ledger append fails with a shardline error."""
    from pathlib import Path

    from shardline.errors import LineageError
    from shardline.hf.checkpoints import record_commit

    run = Path(directory)
    path = run / "checkpoint-1" / "shardline"
    info = ckpt.CheckpointInfo(
        path=path, step=1, manifest_hash="a" * 64, tag=None, kind="sharded", world_size=world, files=1,
        total_bytes=1, parent_manifest_hash=None,
    )  # fmt: skip
    if rank == 0:

        def damaged(self: Any, **kwargs: Any) -> None:
            raise LineageError(f"the lineage ledger {self.path} is unreadable or damaged: file is not a database")

        ckpt.Ledger.append = damaged
    return catch(record_commit, run, path, info)


def full_save_out_of_host_memory_on_rank0(rank: int, world: int, path: str) -> tuple[str, str]:
    """A ``kind="full"`` save while rank 0's host copies run out of memory at the second unit."""
    import importlib

    model, optimizer = build()
    train_step(model, optimizer, 0, rank, world)
    if rank == 0:
        module = importlib.import_module("shardline.engine.state_dict")
        real, calls = module.host_copy, []

        def out_of_memory(tensor: torch.Tensor) -> torch.Tensor:
            calls.append(1)
            if len(calls) == 2:
                raise torch.OutOfMemoryError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 GB")
            return real(tensor)

        module.host_copy = out_of_memory
    return catch(ckpt.save, path, model=model, optimizer=optimizer, step=1, kind="full")


def async_host_staging(rank: int, world: int, directory: str) -> dict[str, Any]:
    """Two async saves through one manager: what the staging held and handed to the digests, and a resume.

    Returns plain facts for the test to check: storages, byte counts, data pointers, the engine's
    memory accounting around the first save, and whether the second checkpoint loads back bit-identically.
    """
    import threading

    from torch.distributed.tensor import DTensor

    from shardline.checkpoint.faults.observer import NO_OBSERVER, SaveObserver
    from shardline.checkpoint.integrity import copy_check

    class Hold(SaveObserver):
        def __init__(self) -> None:
            self.release = threading.Event()

        def before_write(self, path: str, nbytes: int, rank: int) -> None:
            assert self.release.wait(60), "the test never released the writer"

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    def tensors(obj: Any) -> list[torch.Tensor]:
        if isinstance(obj, torch.Tensor):
            return [local(obj)]
        if isinstance(obj, dict):
            return [t for v in obj.values() for t in tensors(v)]
        if isinstance(obj, (list, tuple)):
            return [t for v in obj for t in tensors(v)]
        return []

    model, optimizer = build()
    train_step(model, optimizer, 0, rank, world)
    held = [local(t) for t in [*model.parameters(), *model.buffers()]]
    held += [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    model_storages = [(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in held]
    live = {"model": ckpt.model_state_dict(model), "optim": ckpt.optimizer_state_dict(model, optimizer)}
    one_copy = {(t.data_ptr(), tuple(t.shape), t.dtype): t.numel() * t.element_size() for t in tensors(live)}
    del live

    hashed: list[torch.Tensor] = []
    real_add = copy_check.StagedDigester.add

    def spy(self: Any, tensor: torch.Tensor) -> None:
        hashed.append(tensor)
        real_add(self, tensor)

    copy_check.StagedDigester.add = spy  # type: ignore[method-assign]
    out: dict[str, Any] = {}
    try:
        manager = ckpt.CheckpointManager(directory, async_save=True)
        pool = manager.staging_buffers
        assert pool is not None
        hold = Hold()
        manager.observer = hold
        before = shardline.memory_stats(model, optimizer=optimizer)
        manager.save(ckpt.SaveRequest(step=1, model=model, optimizer=optimizer))  # returns once staged
        during = shardline.memory_stats(model, optimizer=optimizer)
        first = pool.buffers
        out["one_copy_bytes"] = sum(one_copy.values())
        out["pool_bytes"] = pool.nbytes
        out["buffers"] = len(first)
        out["tensors"] = len(one_copy)
        out["buffer_bytes"] = sum(b.untyped_storage().nbytes() for b in first)
        out["memory_unchanged"] = before == during
        out["all_on_host"] = all(b.device.type == "cpu" and not b.is_pinned() for b in first)
        starts = {b.untyped_storage().data_ptr() for b in first}
        out["hashed_are_buffers"] = {t.untyped_storage().data_ptr() for t in hashed} == starts
        out["buffers_outside_model"] = not any(
            start <= b.data_ptr() < start + size for b in first for start, size in model_storages
        )
        train_step(model, optimizer, 1, rank, world)  # training goes on while the write is held
        hold.release.set()
        manager.wait()
        manager.observer = NO_OBSERVER
        expected = snapshot(model, optimizer)
        hashed.clear()
        manager.save(ckpt.SaveRequest(step=2, model=model, optimizer=optimizer))
        second = pool.buffers
        out["reused"] = [b.data_ptr() for b in second] == [b.data_ptr() for b in first]
        out["same_buffers"] = all(a is b for a, b in zip(first, second, strict=True))
        out["hashed_are_buffers_again"] = {t.untyped_storage().data_ptr() for t in hashed} == starts
        train_step(model, optimizer, 2, rank, world)
        info = manager.wait()
        manager.close()
        out["freed_on_close"] = pool.nbytes == 0 and pool.buffers == ()
    finally:
        copy_check.StagedDigester.add = real_add  # type: ignore[method-assign]
    assert info is not None
    loaded, loaded_optimizer = build(seed=123)
    ckpt.load(info.path, model=loaded, optimizer=loaded_optimizer)
    got = snapshot(loaded, loaded_optimizer)  # rank 0 holds the full state
    out["resumed_identical"] = _same(unpack(got), unpack(expected)) if rank == 0 else None
    return out


def stateless_optimizer_roundtrip(rank: int, world: int, path: str) -> dict[str, Any]:
    """Save with plain SGD (no momentum: its state dict's ``state`` is empty), load into a fresh SGD."""
    model, _ = build(seed=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.25)
    train_step(model, optimizer, 0, rank, world)
    before = snapshot(model, optimizer)
    ckpt.save(path, model=model, optimizer=optimizer, step=1)
    fresh_model, _ = build(seed=2)
    fresh = torch.optim.SGD(fresh_model.parameters(), lr=0.5)
    ckpt.load(path, model=fresh_model, optimizer=fresh)
    return {
        "same_model": snapshot(fresh_model, fresh) == before,
        "lr": fresh.param_groups[0]["lr"],
        "state": len(fresh.state),
    }
