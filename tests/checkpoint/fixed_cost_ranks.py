"""Rank functions for the tests of a save's fixed per-save costs (collectives, fsyncs): module level, picklable."""

from __future__ import annotations

import collections
import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.distributed_c10d as c10d

import shardline.checkpoint as ckpt
from shardline import _torch_compat
from shardline.checkpoint.coordination import coord
from tests.checkpoint.ranks import build

# The point-to-group primitives every object collective (DCP's gather_object, shardline's coord) ends in.
PRIMITIVES = (
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "gather",
    "scatter",
    "all_reduce",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "barrier",
    "send",
    "recv",
)


@contextlib.contextmanager
def counting_collectives() -> Iterator[collections.Counter[str]]:
    """Count every gloo round trip this process starts (each primitive collective, whatever called it)."""
    counts: collections.Counter[str] = collections.Counter()
    patched: list[tuple[Any, str, Any]] = []
    originals = {name: getattr(c10d, name) for name in PRIMITIVES if hasattr(c10d, name)}
    for name, original in originals.items():

        def counted(*args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
            counts[_name] += 1
            return _original(*args, **kwargs)

        for module in (c10d, dist):
            if getattr(module, name, None) is original:
                patched.append((module, name, original))
                setattr(module, name, counted)
    bound = _torch_compat._all_gather  # bound at import: shardline's all-gathers go through it

    def counted_all_gather(*args: Any, **kwargs: Any) -> Any:
        counts["all_gather_single"] += 1
        return bound(*args, **kwargs)

    _torch_compat._all_gather = counted_all_gather
    try:
        yield counts
    finally:
        _torch_compat._all_gather = bound
        for module, name, original in patched:
            setattr(module, name, original)


def save_collectives(rank: int, world: int, root: str) -> dict[str, Any]:
    """Round trips of one plain DCP save and of one shardline save of the same model (after a warm-up save);
    and of the control messages a small and a large payload cost."""
    warnings.simplefilter("ignore")
    model, optimizer = build()
    ckpt.save(Path(root) / "warm", model=model, optimizer=optimizer, step=0)  # calibration, first-use costs
    dist.barrier()
    with counting_collectives() as plain:
        state = {"model": ckpt.model_state_dict(model), "optim": ckpt.optimizer_state_dict(model, optimizer)}
        dcp.save(state, storage_writer=dcp.FileSystemWriter(Path(root) / "plain"))
    dist.barrier()
    with counting_collectives() as ours:
        info = ckpt.save(Path(root) / "step-1", model=model, optimizer=optimizer, step=1)
    manager = ckpt.CheckpointManager(Path(root) / "run")
    manager.save(ckpt.SaveRequest(step=1, model=model, optimizer=optimizer))  # the first: the ledger's genesis
    dist.barrier()
    with counting_collectives() as managed:
        manager.save(ckpt.SaveRequest(step=2, model=model, optimizer=optimizer))
    manager.close()
    dist.barrier()
    with counting_collectives() as small:
        got_small = coord.broadcast_object({"rank": rank} if rank == 0 else None, None)
        gathered_small = coord.all_gather_object(rank, None)
    big = "x" * (20_000 + rank * 5_000)  # longer than one frame, a different length on each rank
    with counting_collectives() as large:
        got_large = coord.broadcast_object(big if rank == 0 else None, None)
        gathered_large = coord.all_gather_object(big, None)
    # Messages around one frame's capacity: encoded, these grow from about 4,010 to 4,200 bytes in steps of 64,
    # crossing the 4,088 a frame carries (rank 1's are longer, so sometimes one rank's fits and the other's not).
    edges_ok = True
    for n in range(2_700, 2_900, 3):
        payload = bytes([rank]) * (n + 64 * rank)
        edges_ok &= coord.broadcast_object(payload, None) == bytes([0]) * n
        edges_ok &= coord.all_gather_object(payload, None) == [bytes([r]) * (n + 64 * r) for r in range(world)]
    ok = (
        edges_ok
        and got_small == {"rank": 0}
        and gathered_small == list(range(world))
        and got_large == "x" * 20_000
        and gathered_large == ["x" * (20_000 + r * 5_000) for r in range(world)]
    )
    return {
        "plain": sum(plain.values()),
        "ours": sum(ours.values()),
        "ours_by_kind": dict(ours),
        "manager": sum(managed.values()),
        "small": sum(small.values()),
        "large": sum(large.values()),
        "payloads_ok": ok,
        "verified": rank != 0 or ckpt.verify_checkpoint(info.path).ok,
        "torch": torch.__version__,
    }


def load_collectives(rank: int, world: int, root: str) -> dict[str, Any]:
    """Round trips of one plain DCP load and of one verified shardline load of the same checkpoint (after a
    warm-up load of each), and whether the verified load restored the saved values."""
    warnings.simplefilter("ignore")
    model, optimizer = build()
    path = Path(root) / "step-1"
    ckpt.save(path, model=model, optimizer=optimizer, step=1)
    saved = {k: v.detach().clone() for k, v in ckpt.model_state_dict(model).items()}

    def plain_load() -> None:
        state = {"model": ckpt.model_state_dict(model), "optim": ckpt.optimizer_state_dict(model, optimizer)}
        dcp.load(state, checkpoint_id=path)

    plain_load()
    ckpt.load(path, model=model, optimizer=optimizer)
    with torch.no_grad():
        for value in ckpt.model_state_dict(model).values():
            value.zero_()  # the loads below must bring the saved values back
    dist.barrier()
    with counting_collectives() as plain:
        plain_load()
    dist.barrier()
    with counting_collectives() as ours:
        ckpt.load(path, model=model, optimizer=optimizer, verify="full")
    restored = all(torch.equal(saved[k], v) for k, v in ckpt.model_state_dict(model).items())
    manager = ckpt.CheckpointManager(Path(root) / "run")
    info = manager.save(ckpt.SaveRequest(step=1, model=model, optimizer=optimizer))
    manager.wait()
    manager.load("auto", model=model, optimizer=optimizer)  # warm-up
    dist.barrier()
    with counting_collectives() as resumed:
        manager.load("auto", model=model, optimizer=optimizer, verify="full")
    chained = manager.parent_manifest_hash == info.manifest_hash
    manager.close()
    return {
        "plain": sum(plain.values()),
        "ours": sum(ours.values()),
        "ours_by_kind": dict(ours),
        "manager": sum(resumed.values()),
        "chained": chained,
        "restored": restored,
    }


def load_unprepared_on_one_rank(rank: int, world: int, root: str) -> dict[str, Any]:
    """A verified load where rank 1 alone cannot prepare (its ``.metadata`` check fails; rank 0's passes): the
    error each rank raises, whether this rank's model kept its values, and whether a load then still works."""
    import importlib

    from shardline.errors import IntegrityError, ShardlineError

    warnings.simplefilter("ignore")
    model, optimizer = build()
    path = Path(root) / "step-1"
    ckpt.save(path, model=model, optimizer=optimizer, step=1)
    saved = {k: v.detach().clone() for k, v in ckpt.model_state_dict(model).items()}
    other, other_optimizer = build(seed=123)
    before = {k: v.detach().clone() for k, v in ckpt.model_state_dict(other).items()}
    load_module = importlib.import_module("shardline.checkpoint.lifecycle.load")  # the package's `load` is the function
    real = load_module.read_checked_metadata
    if rank == 1:

        def damaged(checked: Any) -> Any:
            raise IntegrityError("this rank read a .metadata that does not match the manifest")

        load_module.read_checked_metadata = damaged
    try:
        ckpt.load(path, model=other, optimizer=other_optimizer)
        error = ("no error", "")
    except ShardlineError as e:
        error = (type(e).__name__, str(e))
    kept = all(torch.equal(before[k], v) for k, v in ckpt.model_state_dict(other).items())
    load_module.read_checked_metadata = real
    ckpt.load(path, model=other, optimizer=other_optimizer)  # the group is still usable: a load now succeeds
    loaded = all(torch.equal(saved[k], v) for k, v in ckpt.model_state_dict(other).items())
    return {"error": error, "kept": kept, "loaded": loaded}
