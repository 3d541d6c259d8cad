"""Run a function on W freshly started ranks of a gloo (or NCCL) process group, from a test.

>>> def check(rank, world_size, scale):
...     t = torch.ones(1) * rank * scale
...     dist.all_reduce(t)
...     return t.item()
>>> run_distributed(check, world_size=2, args=(3.0,))
[3.0, 3.0]

Ranks are forked from a forkserver that has already imported torch and shardline, so a
group starts in tens of milliseconds instead of seconds. Each rank runs with
``OMP_NUM_THREADS=1`` and one intra-op thread, joins the group through a file store in a
private temporary directory (no port to race for; ``MASTER_ADDR``/``MASTER_PORT`` are still set
to a free port for code that reads them), and reports its return value or its exception (with
traceback) to the parent.

Failure modes, all bounded by ``timeout``:

* a rank raises -> :class:`RankFailedError` with that rank's traceback (and, after a short
  grace period for the others to report, theirs);
* a rank dies without reporting (segfault, ``os._exit``) -> :class:`RankFailedError` with its exit code;
* nothing finishes in time -> :class:`DistributedTimeoutError`, with the Python stack of every
  hung rank (dumped by ``faulthandler`` just before the deadline).

The process-group timeout is set just under ``timeout`` so a collective whose peer died
fails inside the rank, with a traceback, before the parent gives up.
"""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardline.distributed import free_port
from shardline.engine.device import backend_device_map
from shardline.errors import ConfigurationError, ShardlineError

__all__ = ["DistributedTimeoutError", "RankFailedError", "rank_device", "run_distributed"]

_GRACE_S = 3.0  # how long the other ranks get to report after one failed
# Errors a rank raises only because a peer died; never reported as the cause if a real one exists.
_FALLOUT = ("Connection closed by peer", "Connection reset by peer", "remote worker crashing")
_PRELOAD = ["torch", "torch.distributed", "shardline", "shardline.testing._warmup"]

_Report = tuple[int, bool, Any]
"""What a rank sends back: its rank, whether ``fn`` returned, and its return value or its traceback."""


class RankFailedError(ShardlineError, RuntimeError):
    """A rank raised or died. ``failures`` maps rank -> traceback text (or exit description)."""

    def __init__(self, message: str, failures: Mapping[int, str]) -> None:
        super().__init__(message)
        self.failures = dict(failures)


class DistributedTimeoutError(ShardlineError, TimeoutError):
    """The ranks did not finish within the deadline. ``stacks`` maps rank -> its dumped stack."""

    def __init__(self, message: str, stacks: Mapping[int, str]) -> None:
        super().__init__(message)
        self.stacks = dict(stacks)


def _context() -> multiprocessing.context.ForkServerContext | multiprocessing.context.SpawnContext:
    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        return ctx
    return multiprocessing.get_context("spawn")


def uses_nccl(backend: str | None, *, cuda_available: bool) -> bool:
    """Whether a group created with ``backend`` communicates CUDA tensors through NCCL.

    ``None`` is torch's default: gloo for CPU tensors and, where CUDA is available, NCCL for CUDA ones.
    """
    if backend is None:
        return cuda_available
    return backend_device_map(backend).get("cuda") == "nccl"


def rank_device(
    backend: str | None, *, local_rank: int, cuda_available: bool, device_count: int
) -> torch.device | None:
    """The CUDA device a rank must select before anything touches CUDA, or None (no NCCL).

    NCCL binds a communicator to the current device, and object collectives and the group's
    control device (``torch.cuda.current_device()``) use it too, so each rank takes the device of
    its local rank first. Several ranks cannot share one GPU under NCCL.

    Raises:
        ConfigurationError: NCCL without a CUDA device for this local rank.
    """
    if not uses_nccl(backend, cuda_available=cuda_available):
        return None
    if not cuda_available or local_rank >= device_count:
        raise ConfigurationError(
            f"backend {backend!r} runs CUDA collectives on NCCL, which needs one GPU per rank, but local rank "
            f"{local_rank} has none (CUDA available: {cuda_available}, {device_count} devices). Run at most "
            f"{device_count} ranks per machine with NCCL, or use backend='gloo' for CPU tensors."
        )
    return torch.device("cuda", local_rank)


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    init_method: str,
    backend: str | None,
    pg_timeout_s: float,
    stack_file: str,
    dump_after_s: float,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    env: Mapping[str, str],
    results: multiprocessing.queues.Queue[_Report],
) -> None:
    os.environ.update(
        {
            "OMP_NUM_THREADS": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            **env,
        }
    )
    with open(stack_file, "w") as stack_out:
        faulthandler.dump_traceback_later(dump_after_s, exit=False, file=stack_out)
        try:
            torch.set_num_threads(1)
            device = rank_device(
                backend,
                local_rank=rank,
                cuda_available=torch.cuda.is_available(),
                device_count=torch.cuda.device_count(),
            )
            if device is not None:  # before anything touches CUDA: NCCL binds to the current device
                torch.cuda.set_device(device)
            dist.init_process_group(
                backend=backend,
                init_method=init_method,
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=pg_timeout_s),
            )
            # Note: gloo's connection setup can return on one rank while a peer still reads its side
            # of the handshake; a rank whose function needs no collective would then finish and close
            # its sockets under that peer ("connectFullMesh failed ... Connection closed by peer", seen
            # on a loaded machine). One barrier holds every rank until all have connected.
            if backend == "gloo" and world_size > 1:
                dist.barrier()
            report = (rank, True, fn(rank, world_size, *args, **kwargs))
        except BaseException:
            report = (rank, False, traceback.format_exc())
        # Report before tearing the group down: peers notice the teardown as "connection closed",
        # and the parent should hear this rank's own error first.
        results.put(report)
        results.close()
        results.join_thread()
        faulthandler.cancel_dump_traceback_later()
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    timeout: float = 90.0,
    backend: str | None = "gloo",
    env: Mapping[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` new ranks; return their results.

    ``fn`` must be importable by name (a module-level function) and its return value
    picklable. Raises :class:`RankFailedError` or :class:`DistributedTimeoutError` as
    described in the module docstring; never blocks longer than about ``timeout`` seconds.

    ``backend`` is passed to ``init_process_group`` (``None``: torch's default). With NCCL
    (``"nccl"``, ``"cpu:gloo,cuda:nccl"``, or ``None`` where CUDA is available) each rank first
    selects the GPU of its local rank (:func:`rank_device`); a machine with fewer GPUs than
    ``world_size`` is refused before any rank starts.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if uses_nccl(backend, cuda_available=torch.cuda.is_available()):
        rank_device(  # raises, naming the counts, when the last rank would have no GPU of its own
            backend,
            local_rank=world_size - 1,
            cuda_available=torch.cuda.is_available(),
            device_count=torch.cuda.device_count(),
        )
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    deadline = time.monotonic() + timeout
    pg_timeout = max(5.0, timeout - 10.0)
    dump_after = max(1.0, timeout - 4.0)
    with tempfile.TemporaryDirectory(prefix="shardline-ranks-") as tmp:
        stack_files = [str(Path(tmp) / f"rank{r}.stack") for r in range(world_size)]
        # Rendezvous through a file, not a TCP port: a port picked as free can be taken by another
        # process before rank 0 binds it, which made runs fail at random on a busy machine.
        init_method = f"file://{Path(tmp) / 'rendezvous'}"
        procs = [
            ctx.Process(
                target=_worker,
                args=(
                    fn,
                    r,
                    world_size,
                    port,
                    init_method,
                    backend,
                    pg_timeout,
                    stack_files[r],
                    dump_after,
                    tuple(args),
                    dict(kwargs or {}),
                    dict(env or {}),
                    results,
                ),
                name=f"shardline-rank{r}",
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        try:
            return _collect(procs, results, deadline, stack_files, timeout)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(timeout=5)
            results.close()


def _collect(
    procs: Sequence[multiprocessing.process.BaseProcess],
    results: multiprocessing.queues.Queue[_Report],
    deadline: float,
    stack_files: list[str],
    timeout: float,
) -> list[Any]:
    world_size = len(procs)
    values: dict[int, Any] = {}
    failures: dict[int, str] = {}
    exited_at: dict[int, float] = {}
    failed_at: float | None = None

    def pending() -> list[int]:
        return [r for r in range(world_size) if r not in values and r not in failures]

    while pending():
        now = time.monotonic()
        if failed_at is not None and now - failed_at > _GRACE_S:
            break
        if now > deadline:
            time.sleep(4.5)  # let faulthandler's dumps (due just before the deadline) land
            stacks = {r: _read(stack_files[r]) for r in pending()}
            detail = "\n".join(f"--- rank {r} stack ---\n{s or '(no stack dumped)'}" for r, s in stacks.items())
            raise DistributedTimeoutError(
                f"ranks {sorted(stacks)} of {world_size} did not finish within {timeout:.0f}s "
                f"(likely a hang in a collective).\n{detail}",
                stacks,
            )
        try:
            rank, ok, payload = results.get(timeout=0.05)
        except queue.Empty:
            for r in pending():  # exited without reporting? (allow a moment for a late report)
                if not procs[r].is_alive() and now - exited_at.setdefault(r, now) > 1.0:
                    failures[r] = f"rank {r} exited with code {procs[r].exitcode} without reporting a result"
                    failed_at = failed_at or now
            continue
        if ok:
            values[rank] = payload
        else:
            failures[rank] = payload
            failed_at = failed_at or time.monotonic()
    if failures:
        # The first to report is usually the cause; a peer that only saw it die is fallout.
        primary = [r for r in failures if not any(m in failures[r] for m in _FALLOUT)] or list(failures)
        first = primary[0]
        others = "".join(f"\n--- rank {r} ---\n{failures[r]}" for r in sorted(failures) if r != first)
        raise RankFailedError(
            f"rank {first} of {world_size} failed:\n{failures[first]}"
            + (f"\nother failing ranks:{others}" if others else ""),
            failures,
        )
    return [values[r] for r in range(world_size)]


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""
