"""Measure this machine for the planner: matmul rate, gloo collective bandwidth, optimizer bandwidth.

``shardline plan --calibrate`` starts ``ranks`` gloo processes of one thread each (as
``shardline bench`` runs its ranks) and, on every rank at once so they contend as in training:

* times an fp32 matmul of the shape a transformer MLP has (``tokens x dim`` by ``dim x 4dim``):
  the achieved FLOP rate, used as the device's peak with a ``compute`` efficiency of 1;
* times all-reduces, all-gathers and reduce-scatters of a large buffer through shardline's own
  collectives (:class:`shardline.engine.TorchCollectives`: on gloo an all-gather is an all-reduce
  of a zeroed buffer, a reduce-scatter an all-reduce and a copy), as bus bandwidth
  (``2(n-1)/n`` of the buffer per rank per second for an all-reduce, ``(n-1)/n`` for the others);
* times ``torch.optim.AdamW.step()`` on four ``dim x 4dim`` parameters (the MLP's shapes: the
  optimizer's speed depends on the tensor sizes through the caches): bytes streamed per second,
  the memory bandwidth of the optimizer step;
* times, on a buffer as large as the collectives' (the size of the engine's gather buffers):
  ``copy_`` between two warm buffers (bytes copied per second), ``zero_`` of a warm buffer (bytes
  zeroed per second), and ``zero_`` of a buffer allocated just before: the difference between
  the last two is the cost of a first touch (a fresh ``mmap``'s page faults), expressed as
  bytes per second. These price the engine's own memory work (:mod:`.host_traffic`).

Each figure is the best of several repetitions (each repetition as long as its slowest rank):
on a machine shared with other work the best repetition is the machine's own speed and the
slower ones are the others' load, so the plan predicts the fastest steps of a benchmark run on
the same machine (``shardline bench`` records every step). The result is a
:class:`~.devices.Device` of class ``cpu``, saved as JSON so a later plan (or a test) reuses it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardline.diagnostics.plan.cost import ADAMW_BYTES_PER_PARAM
from shardline.diagnostics.plan.devices import Device, DeviceClass
from shardline.errors import ConfigurationError

__all__ = ["Calibration", "calibrate", "load_calibration"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Calibration:
    """What ``--calibrate`` measured (rates per rank, all ranks running at once).

    Attributes:
        ranks: Processes measured together (the ``gpus_per_node`` of the plan).
        matmul_gflops: Achieved fp32 matmul rate, GFLOP/s.
        all_reduce_gbps: gloo all-reduce bus bandwidth, Gb/s.
        all_gather_gbps: All-gather bus bandwidth as shardline issues it on gloo, Gb/s.
        reduce_scatter_gbps: Reduce-scatter bus bandwidth as shardline issues it on gloo, Gb/s.
        optimizer_gbps: AdamW streaming bandwidth, Gb/s.
        copy_gbps: ``copy_`` between warm buffers, bytes copied per second, Gb/s (None: a calibration
            saved before this was measured; then the engine's memory work is not charged).
        fill_gbps: ``zero_`` of a warm buffer, Gb/s (None: as ``copy_gbps``).
        first_touch_gbps: Freshly allocated bytes per second of extra time their first write
            takes over a warm one, Gb/s (None: as ``copy_gbps``).
        memory_gib: Memory per rank (the machine's memory shared by the ranks), GiB.
        shape: The matmul measured, ``(tokens, dim, 4 * dim)``.
    """

    ranks: int
    matmul_gflops: float
    all_reduce_gbps: float
    all_gather_gbps: float
    reduce_scatter_gbps: float
    optimizer_gbps: float
    memory_gib: float
    shape: tuple[int, int, int]
    copy_gbps: float | None = None
    fill_gbps: float | None = None
    first_touch_gbps: float | None = None

    @property
    def host_memory_gbps(self) -> tuple[float, float, float] | None:
        """Copy, fill and first-touch rates, when this calibration measured them."""
        if self.copy_gbps is None or self.fill_gbps is None or self.first_touch_gbps is None:
            return None
        return (self.copy_gbps, self.fill_gbps, self.first_touch_gbps)

    def device(self) -> Device:
        """This machine as a planner device (one rank = one "GPU")."""
        return Device(
            name=f"this machine, {self.ranks} gloo ranks (measured)",
            peak_tflops=self.matmul_gflops / 1e3,
            memory_gib=self.memory_gib,
            memory_gbps=self.optimizer_gbps,
            intra_node_gbps=self.all_reduce_gbps,
            inter_node_gbps=self.all_reduce_gbps,
            device_class=DeviceClass.CPU,
            note="measured by shardline plan --calibrate",
            measured_bus_gbps=(
                ("all_reduce", self.all_reduce_gbps),
                ("all_gather", self.all_gather_gbps),
                ("reduce_scatter", self.reduce_scatter_gbps),
            ),
            host_memory_gbps=self.host_memory_gbps,
        )

    def save(self, path: str | Path) -> None:
        """Write the measurement as JSON."""
        Path(path).write_text(json.dumps(dataclasses.asdict(self), indent=2) + "\n")


def load_calibration(path: str | Path) -> Calibration:
    """A measurement saved by :meth:`Calibration.save`."""
    try:
        raw: dict[str, Any] = json.loads(Path(path).read_text())
        raw["shape"] = tuple(raw["shape"])
        return Calibration(**raw)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise ConfigurationError(
            f"--calibration {path} is not a saved calibration ({exc}); write one with shardline plan --calibrate"
        ) from None


def _best_slowest(samples: list[float]) -> float:
    t = torch.tensor(samples, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a repetition lasts as long as its slowest rank
    slowest: list[float] = t.tolist()
    return min(slowest)


def _timed(fn: Callable[[], object], repeats: int) -> list[float]:
    fn()  # warm-up
    out = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def _measure(rank: int, world: int, shape: tuple[int, int, int], comm_mib: int, repeats: int) -> dict[str, float]:
    from shardline.engine import TorchCollectives

    m, k, n = shape
    a, b = torch.randn(m, k), torch.randn(k, n)

    def matmuls() -> None:
        for _ in range(4):
            torch.mm(a, b)

    # Note: a fresh process's first matmuls run slow (cold caches and pages, a clock still ramping; the bench
    # discards a warm-up step for the same reason), and one short burst of repetitions can fall entirely in
    # such a window: two calibrations minutes apart measured 41 and 74 GFLOP/s. So the matmul is warmed up for
    # about half a second and measured twice, here and again after everything else, and the better is kept.
    deadline = time.perf_counter() + 0.5
    while time.perf_counter() < deadline:
        matmuls()
    mm = _best_slowest(_timed(matmuls, repeats)) / 4
    group = dist.group.WORLD
    assert group is not None  # the calibration's ranks run in a process group
    comm = TorchCollectives()
    full = torch.ones(comm_mib * 2**20 // 4)
    piece = torch.ones(full.numel() // world)
    ar = _best_slowest(_timed(lambda: comm.all_reduce(full, group, op=dist.ReduceOp.SUM, async_op=False), repeats))
    ag = _best_slowest(_timed(lambda: comm.all_gather(full, piece, group, async_op=False), repeats))
    rs = _best_slowest(
        _timed(lambda: comm.reduce_scatter(piece, full, group, op=dist.ReduceOp.SUM, async_op=False), repeats)
    )
    params = [torch.nn.Parameter(torch.randn(k, n) * 0.02) for _ in range(4)]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = torch.optim.AdamW(params, lr=1e-3)
    step = _best_slowest(_timed(opt.step, repeats))
    source, target = torch.ones_like(full), torch.ones_like(full)
    copy = _best_slowest(_timed(lambda: target.copy_(source), repeats))
    fill = _best_slowest(_timed(target.zero_, repeats))
    fresh = _best_slowest(_timed(lambda: torch.empty_like(full).zero_(), repeats))
    mm = min(mm, _best_slowest(_timed(matmuls, repeats)) / 4)
    nbytes = full.numel() * 4
    frac = (world - 1) / world
    return {
        "matmul_gflops": 2 * m * k * n / mm / 1e9,
        "all_reduce_gbps": 2 * frac * nbytes / ar * 8 / 1e9,
        "all_gather_gbps": frac * nbytes / ag * 8 / 1e9,
        "reduce_scatter_gbps": frac * nbytes / rs * 8 / 1e9,
        "optimizer_gbps": ADAMW_BYTES_PER_PARAM * 4 * k * n / step * 8 / 1e9,
        "copy_gbps": nbytes / copy * 8 / 1e9,
        "fill_gbps": nbytes / fill * 8 / 1e9,
        # a first touch costs at least a hundredth of the whole fresh write (no division by ~0 where
        # an allocator hands back warm pages)
        "first_touch_gbps": nbytes / max(fresh - fill, fresh / 100) * 8 / 1e9,
    }


def calibrate(
    *, ranks: int = 2, shape: tuple[int, int, int] = (256, 1024, 4096), comm_mib: int = 64, repeats: int = 9
) -> Calibration:
    """Measure this machine with ``ranks`` one-thread gloo processes (a few seconds)."""
    from shardline.testing import run_distributed

    if ranks < 2:
        raise ConfigurationError(f"--calibrate needs >= 2 ranks to measure collectives, got {ranks}")
    results = run_distributed(_measure, ranks, args=(shape, comm_mib, repeats), timeout=300.0)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Calibration(ranks=ranks, memory_gib=total / 2**30 / ranks, shape=shape, **results[0])
