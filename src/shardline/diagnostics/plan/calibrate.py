"""Measure this machine for the planner: matmul rate, gloo collective bandwidth, optimizer bandwidth.

``shardline plan --calibrate`` starts ``ranks`` gloo processes of one thread each (as
``shardline bench`` runs its ranks) and, on every rank at once so they contend as in training:

* times an fp32 matmul of the shape a transformer MLP has (``tokens x dim`` by ``dim x 4dim``):
  the achieved FLOP rate, used as the device's peak with a ``compute`` efficiency of 1;
* times all-reduces and all-gathers of a large buffer: ring bus bandwidth
  (``2(n-1)/n`` resp. ``(n-1)/n`` of the buffer per rank per second); shardline issues every
  collective on gloo as an all-reduce, so the all-reduce figure is the link the planner uses;
* times ``torch.optim.AdamW.step()`` on a flat parameter: bytes streamed per second, the memory
  bandwidth of the optimizer step.

Each figure is the median of several repetitions, the slowest rank's. The result is a
:class:`~.devices.Device` of class ``cpu``, saved as JSON so a later plan (or a test) reuses it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time
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
        all_gather_gbps: gloo all-gather bus bandwidth, Gb/s.
        optimizer_gbps: AdamW streaming bandwidth, Gb/s.
        memory_gib: Memory per rank (the machine's memory shared by the ranks), GiB.
        shape: The matmul measured, ``(tokens, dim, 4 * dim)``.
    """

    ranks: int
    matmul_gflops: float
    all_reduce_gbps: float
    all_gather_gbps: float
    optimizer_gbps: float
    memory_gib: float
    shape: tuple[int, int, int]

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


def _median_slowest(samples: list[float]) -> float:
    t = torch.tensor(samples, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return statistics.median(t.tolist())


def _timed(fn: Any, repeats: int) -> list[float]:
    fn()  # warm-up
    out = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def _measure(rank: int, world: int, shape: tuple[int, int, int], comm_mib: int, repeats: int) -> dict[str, float]:
    m, k, n = shape
    a, b = torch.randn(m, k), torch.randn(k, n)
    mm = _median_slowest(_timed(lambda: [torch.mm(a, b) for _ in range(4)], repeats)) / 4
    buf = torch.ones(comm_mib * 2**20 // 4)
    outs = [torch.empty_like(buf) for _ in range(world)]
    ar = _median_slowest(_timed(lambda: dist.all_reduce(buf), repeats))
    ag = _median_slowest(_timed(lambda: dist.all_gather(outs, buf), repeats))
    param = torch.nn.Parameter(torch.zeros(8 * 2**20))
    param.grad = torch.ones_like(param)
    opt = torch.optim.AdamW([param], lr=1e-3)
    step = _median_slowest(_timed(opt.step, repeats))
    nbytes = buf.numel() * 4
    frac = (world - 1) / world
    return {
        "matmul_gflops": 2 * m * k * n / mm / 1e9,
        "all_reduce_gbps": 2 * frac * nbytes / ar * 8 / 1e9,
        "all_gather_gbps": frac * world * nbytes / ag * 8 / 1e9,
        "optimizer_gbps": ADAMW_BYTES_PER_PARAM * param.numel() / step * 8 / 1e9,
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
