"""Rank functions for the tests of the agreements' costs (bytes received, collectives): module level, picklable."""

from __future__ import annotations

import collections
import contextlib
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

import shardline.checkpoint as ckpt
from shardline import _torch_compat
from shardline.checkpoint.coordination import coord
from shardline.errors import IntegrityError, ShardlineError
from tests.checkpoint.ranks import build

Counts = collections.Counter[str]


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


@contextlib.contextmanager
def counting_received() -> Iterator[tuple[Counts, Counts]]:
    """Calls of, and bytes landing in this rank's output tensors of, the collectives control messages end in:
    shardline's all-gathers (``_torch_compat``: "all_gather_single"), and torch's ``all_reduce``, ``broadcast``
    and list-form ``all_gather`` (the two inside ``all_gather_object``), wherever they are called from."""
    calls: Counts = collections.Counter()
    received: Counts = collections.Counter()
    bound = _torch_compat._all_gather
    originals = {name: getattr(c10d, name) for name in ("all_reduce", "broadcast", "all_gather")}

    def counted_gather(output: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls["all_gather_single"] += 1
        received["all_gather_single"] += _nbytes(output)
        return bound(output, *args, **kwargs)

    def wrap(name: str) -> Any:
        def counted(output: Any, *args: Any, **kwargs: Any) -> Any:
            result = originals[name](output, *args, **kwargs)
            calls[name] += 1
            received[name] += _nbytes(output)
            return result

        return counted

    _torch_compat._all_gather = counted_gather
    for name in originals:
        counted = wrap(name)
        setattr(dist, name, counted)
        setattr(c10d, name, counted)
    try:
        yield calls, received
    finally:
        _torch_compat._all_gather = bound
        for name, original in originals.items():
            setattr(dist, name, original)
            setattr(c10d, name, original)


def agreement_costs(rank: int, world: int, root: str) -> dict[str, Any]:
    """What the agreements of a save, a verified load, ``check_checkpoint`` and the full state dicts receive on
    this rank when every step succeeds (after a warm-up save)."""
    warnings.simplefilter("ignore")
    model, optimizer = build()
    ckpt.save(Path(root) / "warm", model=model, optimizer=optimizer, step=0)
    out: dict[str, Any] = {}
    steps = {
        "save": lambda: ckpt.save(Path(root) / "step-1", model=model, optimizer=optimizer, step=1),
        "load": lambda: ckpt.load(Path(root) / "step-1", model=model, optimizer=optimizer, verify="full"),
        "check": lambda: ckpt.check_checkpoint(Path(root) / "step-1"),
        "full_state": lambda: (
            ckpt.model_state_dict(model, kind="full"),
            ckpt.optimizer_state_dict(model, optimizer, kind="full"),
        ),
    }
    for name, step in steps.items():
        dist.barrier()
        with counting_received() as (calls, received):
            step()
        out[name] = {"calls": dict(calls), "received": dict(received)}
    info = ckpt.save(Path(root) / "step-2", model=model, optimizer=optimizer, step=2)
    out["total_bytes"] = info.total_bytes
    out["files_bytes"] = sum(p.stat().st_size for p in Path(info.path).glob("*.distcp"))
    return out


def _outcome(agree: Callable[..., Any], step: Callable[[], Any]) -> tuple[str, str]:
    try:
        agree(step, None, what="do the step")
    except ShardlineError as e:
        return type(e).__name__, str(e)
    return "no error", ""


def _counting(step: Callable[[], Any]) -> Callable[[], int]:
    return lambda: step() or 1


def agreement_failures(rank: int, world: int) -> dict[str, Any]:
    """``all_succeed`` against ``all_agree`` on the same failing steps: the error each raises on this rank, and the
    collectives ``all_succeed`` makes (the flag, then the payloads)."""
    cases: dict[str, Any] = {
        "one rank": lambda: _fail(IntegrityError("file damaged")) if rank == 1 else None,
        "every rank, same words": lambda: _fail(IntegrityError("disk gone")),
        "every rank, own words": lambda: _fail(OSError(f"rank {rank}'s disk")),
    }
    out: dict[str, Any] = {}
    for name, step in cases.items():
        agreed = _outcome(coord.all_agree, step)
        with counting_received() as (calls, _):
            succeeded = _outcome(coord.all_succeed, step)
        totalled = _outcome(coord.all_succeed_total, _counting(step))
        out[name] = {"all_agree": agreed, "all_succeed": succeeded, "total": totalled, "calls": dict(calls)}
    out["sum"] = coord.all_succeed_total(lambda: 10 * (rank + 1), None, what="count")
    return out


def _fail(error: Exception) -> None:
    raise error


def restart_count_costs(rank: int, world: int) -> dict[str, Any]:
    """The elastic restart's agreement on the job's restart count, with this rank's count ``rank`` (so the ranks
    differ, as when a node joins at 0): what each reader returns, and what it receives."""
    import dataclasses
    import os

    from shardline.train.checkpointing import _elastic_restart_count
    from shardline.train.schema import TrainConfig
    from shardline.train.worker import _resume_on_elastic_restart

    os.environ["TORCHELASTIC_RESTART_COUNT"] = str(2 * rank)
    cfg = TrainConfig()
    cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, resume="none"))
    out: dict[str, Any] = {}
    for name, read in {
        "count": lambda: _elastic_restart_count(world),
        "resume": lambda: _resume_on_elastic_restart(cfg, world)[1],
    }.items():
        dist.barrier()
        with counting_received() as (calls, received):
            value = read()
        out[name] = {"value": value, "calls": dict(calls), "received": dict(received)}
    return out


def load_shares(rank: int, world: int, root: str) -> dict[str, Any]:
    """A verified load's view of the manifest on this rank: the entries ``_checked`` gave it, and the share of the
    data files' entries its load plan carried (after a save of ``world`` ranks)."""
    import importlib

    from shardline.checkpoint.integrity.reading import ASSIGNMENT_KEY, VerifyingReader

    warnings.simplefilter("ignore")
    model, optimizer = build()
    path = Path(root) / "step-1"
    ckpt.save(path, model=model, optimizer=optimizer, step=1)
    load_module = importlib.import_module("shardline.checkpoint.lifecycle.load")
    real_checked, real_read = load_module._checked, VerifyingReader.read_data
    seen: dict[str, Any] = {}

    def checked(*args: Any, **kwargs: Any) -> Any:
        seen["checked"] = real_checked(*args, **kwargs)
        return seen["checked"]

    def read_data(self: VerifyingReader, plan: Any, planner: Any) -> Any:
        seen["share"] = plan.storage_data[ASSIGNMENT_KEY]
        return real_read(self, plan, planner)

    load_module._checked = checked
    VerifyingReader.read_data = read_data  # type: ignore[method-assign]
    try:
        ckpt.load(path, model=model, optimizer=optimizer, verify="full")
    finally:
        load_module._checked = real_checked
        VerifyingReader.read_data = real_read  # type: ignore[method-assign]
    return {
        "entries": seen["checked"].entries(),
        "share": seen["share"],
        "manifest_hash": seen["checked"].manifest_hash,
        "listed": ckpt.check_checkpoint(path)["files"],  # the whole manifest's entries, as check_checkpoint gives
    }
