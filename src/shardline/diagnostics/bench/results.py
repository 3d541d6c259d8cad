"""The engine benchmark's results: records, the targets verdict and JSON.

The measuring lives in :mod:`shardline.diagnostics.bench.run`, the Markdown tables and the chart in
:mod:`shardline.diagnostics.bench.render`; this module only holds what was measured.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from shardline._version import __version__
from shardline.diagnostics.bench.settings import BenchSettings, ModelSize
from shardline.errors import ConfigurationError

__all__ = [
    "BenchResult",
    "CommVolume",
    "ConfigResult",
    "RankMemory",
    "RunResult",
    "Spread",
    "Target",
    "environment",
    "evaluate_targets",
    "load_results",
    "to_json",
]

MIB = 2**20
PHASES = ("forward", "backward", "optimizer")

SCHEMA = "shardline.bench/1"


# ---------------------------------------------------------------------------- records
@dataclasses.dataclass(frozen=True, kw_only=True)
class Spread:
    """Median and spread of a sample of durations, in seconds (``samples`` in the order measured)."""

    median: float
    p25: float
    p75: float
    min: float
    max: float
    n: int
    samples: tuple[float, ...]

    @classmethod
    def of(cls, samples: Sequence[float]) -> Spread:
        xs = sorted(samples)
        if len(xs) >= 2:
            p25, _, p75 = statistics.quantiles(xs, n=4, method="inclusive")
        else:
            p25 = p75 = xs[0]
        return cls(
            median=statistics.median(xs), p25=p25, p75=p75, min=xs[0], max=xs[-1], n=len(xs), samples=tuple(samples)
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class RankMemory:
    """RSS of one rank for one configuration, in bytes (``None``: could not be measured)."""

    rank: int
    baseline: int | None  # the process before the model was built (torch runtime, data)
    # Added by building the model and optimizer and running the warm-up steps: parameters,
    # optimizer state, buffers, and one-time lazy initialization (kernels' code pages, ...).
    state: int | None
    step: int | None  # the steps' peak above the RSS just before them
    hwm: int | None  # the process's peak RSS during the steps (VmHWM): baseline + state + step

    @property
    def peak(self) -> int | None:
        """What this configuration adds on this rank to the runtime baseline: resident state + step peak."""
        return None if self.state is None or self.step is None else self.state + self.step


@dataclasses.dataclass(frozen=True, kw_only=True)
class CommVolume:
    """Logical bytes per step by collective kind: theory and the two measurements.

    ``issued`` is the theory as the c10d counter must see it when it differs from the logical
    kinds (shardline on gloo issues all-gathers and reduce-scatters as all-reduces of the same
    bytes); the engine's own log keeps the logical kinds.
    """

    theory: dict[str, int]
    measured: dict[str, int] | None  # every c10d collective, seen by a dispatch mode
    engine: dict[str, int] | None  # shardline's own count_collectives log (shardline rows)
    issued: dict[str, int] | None = None

    @property
    def matches(self) -> bool:
        """Every measurement present equals the theory, kind by kind."""
        pairs = [(self.measured, self.issued or self.theory), (self.engine, self.theory)]
        got = [(m, t) for m, t in pairs if m is not None]
        return bool(got) and all(_nonzero(m) == _nonzero(t) for m, t in got)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConfigResult:
    """Everything measured for one configuration in one run."""

    key: str
    label: str
    ranks: int
    tokens_per_step: int
    step: Spread  # per step, the slowest rank's time
    rank_steps: tuple[tuple[float, ...], ...]  # every rank's own step times, in the order measured
    phases: dict[str, Spread]
    memory: tuple[RankMemory, ...]
    engine_memory: dict[str, int] | None
    comm: CommVolume
    first_loss: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step.median

    @property
    def peak_rss(self) -> int | None:
        """Peak RSS per rank (``VmHWM``, the largest over the ranks) of a process training only this configuration."""
        peaks = [m.hwm for m in self.memory]
        return None if not peaks or None in peaks else max(p for p in peaks if p is not None)

    @property
    def worst_rank(self) -> RankMemory | None:
        """The rank with the highest peak RSS."""
        return max(self.memory, key=lambda m: m.hwm or 0, default=None)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunResult:
    """One process group's run: one model size, one world size, alternating configurations."""

    kind: str  # "main", "hybrid" (4 ranks, 2x2 mesh) or "w1"
    size: ModelSize
    world_size: int
    micro_batch: int
    rss_method: str
    wall_s: float
    configs: tuple[ConfigResult, ...]

    def get(self, key: str) -> ConfigResult | None:
        return next((c for c in self.configs if c.key == key), None)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Target:
    """One of the issue's targets, evaluated on this run's numbers."""

    name: str
    size: str
    value: float
    comparison: str  # "<=": met when value <= threshold; ">=": met when value >= threshold
    threshold: float
    detail: str

    @property
    def met(self) -> bool:
        return self.value <= self.threshold if self.comparison == "<=" else self.value >= self.threshold


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchResult:
    """A whole benchmark: settings, environment, one :class:`RunResult` per (size, world size), targets."""

    settings: BenchSettings
    environment: dict[str, Any]
    runs: tuple[RunResult, ...]
    targets: tuple[Target, ...] = dataclasses.field(default=())

    def run(self, size: str, kind: str = "main") -> RunResult | None:
        return next((r for r in self.runs if r.size.name == size and r.kind == kind), None)


def _nonzero(volume: dict[str, int]) -> dict[str, int]:
    return {k: v for k, v in volume.items() if v}


def _ratio_target(
    name: str, size: str, ours: ConfigResult | None, peer: ConfigResult | None, threshold: float
) -> Target | None:
    if ours is None or peer is None:
        return None
    return Target(
        name=name,
        size=size,
        value=ours.step.median / peer.step.median,
        comparison="<=",
        threshold=threshold,
        detail=f"{ours.step.median * 1e3:.1f} ms vs {peer.step.median * 1e3:.1f} ms",
    )


def evaluate_targets(result: BenchResult) -> tuple[Target, ...]:
    """The issue's targets, per size: step time vs the peers, peak memory vs FSDP2, bytes vs theory, W=1 overhead."""
    targets: list[Target | None] = []
    for size in result.settings.sizes:
        main, hybrid, w1 = (result.run(size.name, kind) for kind in ("main", "hybrid", "w1"))
        ours = main.get("shardline_full_shard") if main else None
        fsdp2 = main.get("torch_fsdp2") if main else None
        targets.append(_ratio_target("FULL_SHARD step time / FSDP2", size.name, ours, fsdp2, 0.85))
        ddp = main.get("torch_ddp") if main else None
        targets.append(
            _ratio_target(
                "NO_SHARD step time / DDP", size.name, main.get("shardline_no_shard") if main else None, ddp, 1.0
            )
        )
        if hybrid is not None:
            targets.append(
                _ratio_target(
                    "HYBRID_SHARD step time / FSDP2 HSDP (W=4)",
                    size.name,
                    hybrid.get("shardline_hybrid_shard"),
                    hybrid.get("torch_fsdp2_hsdp"),
                    0.9,
                )
            )
        if ours is not None and fsdp2 is not None and ours.peak_rss is not None and fsdp2.peak_rss:
            targets.append(
                Target(
                    name="FULL_SHARD peak RSS / FSDP2",
                    size=size.name,
                    value=ours.peak_rss / fsdp2.peak_rss,
                    comparison="<=",
                    threshold=1.0,
                    detail=f"{ours.peak_rss / MIB:.1f} MiB vs {fsdp2.peak_rss / MIB:.1f} MiB",
                )
            )
        runs = (main, hybrid, w1)
        rows = [c for run in runs if run is not None for c in run.configs if c.key.startswith("shardline")]
        if rows:
            equal = sum(c.comm.matches for c in rows)
            targets.append(
                Target(
                    name="shardline bytes/step == theory",
                    size=size.name,
                    value=equal / len(rows),
                    comparison=">=",
                    threshold=1.0,
                    detail=f"{equal} of {len(rows)} shardline rows measure exactly the theory",
                )
            )
        plain, sharded = (w1.get("plain"), w1.get("shardline_full_shard")) if w1 else (None, None)
        if plain is not None and sharded is not None:
            targets.append(
                Target(
                    name="W=1 overhead vs plain model",
                    size=size.name,
                    value=sharded.step.median / plain.step.median - 1.0,
                    comparison="<=",
                    threshold=0.05,
                    detail=f"{sharded.step.median * 1e3:.1f} ms vs {plain.step.median * 1e3:.1f} ms",
                )
            )
    return tuple(t for t in targets if t is not None)


# ---------------------------------------------------------------------------- environment
def environment(command: str | None) -> dict[str, Any]:
    """Versions, machine and date, recorded with the results."""
    return {
        "shardline": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "threads_per_rank": 1,
        "backend": "gloo",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# ---------------------------------------------------------------------------- JSON
def to_json(result: BenchResult) -> dict[str, Any]:
    """Every raw number, the settings and the environment, as plain JSON types."""
    settings = dataclasses.asdict(result.settings)
    settings["sizes"] = [s.name for s in result.settings.sizes]
    return {
        "schema": SCHEMA,
        "environment": result.environment,
        "settings": settings,
        "runs": [_run_json(run) for run in result.runs],
        "targets": [{**dataclasses.asdict(t), "met": t.met} for t in result.targets],
    }


def _run_json(run: RunResult) -> dict[str, Any]:
    return {
        "kind": run.kind,
        "size": {**dataclasses.asdict(run.size), "num_params": run.size.num_params},
        "world_size": run.world_size,
        "micro_batch": run.micro_batch,
        "rss_method": run.rss_method,
        "wall_s": run.wall_s,
        "configs": [_config_json(c, run) for c in run.configs],
    }


def _config_json(c: ConfigResult, run: RunResult) -> dict[str, Any]:
    fsdp2 = run.get("torch_fsdp2")
    return {
        "key": c.key,
        "label": c.label,
        "ranks": c.ranks,
        "tokens_per_step": c.tokens_per_step,
        "tokens_per_s": c.tokens_per_s,
        "step_s": dataclasses.asdict(c.step),
        "step_s_per_rank": c.rank_steps,
        "phases_s": {name: dataclasses.asdict(s) for name, s in c.phases.items()},
        "ratio_vs_fsdp2": c.step.median / fsdp2.step.median if fsdp2 else None,
        "rss_bytes": [{**dataclasses.asdict(m), "peak": m.peak} for m in c.memory],
        "peak_rss_bytes": c.peak_rss,
        "engine_memory_bytes": c.engine_memory,
        "comm_bytes_per_step": {
            "theory": c.comm.theory,
            "theory_as_issued_c10d": c.comm.issued,
            "measured_c10d": c.comm.measured,
            "measured_engine": c.comm.engine,
            "matches_theory": c.comm.matches,
        },
        "first_loss": c.first_loss,
    }


def load_results(path: str | Path) -> BenchResult:
    """Read a ``results.json`` written by :func:`write_results` back into a :class:`BenchResult`.

    Raises:
        ConfigurationError: The file is missing, not JSON, or not a benchmark result of this schema.
    """
    try:
        data = json.loads(Path(path).read_text())
        if data.get("schema") != SCHEMA:
            raise ValueError(f"schema {data.get('schema')!r} is not {SCHEMA!r}")
        sizes: dict[str, ModelSize] = {}
        runs = []
        for run in data["runs"]:
            size = ModelSize(**{k: v for k, v in run["size"].items() if k != "num_params"})
            sizes.setdefault(size.name, size)
            configs = tuple(_config_from_json(c) for c in run["configs"])
            fields = {k: run[k] for k in ("kind", "world_size", "micro_batch", "rss_method", "wall_s")}
            runs.append(RunResult(size=size, configs=configs, **fields))
        given = {**data["settings"], "sizes": tuple(sizes[n] for n in data["settings"]["sizes"])}
        given["configs"] = tuple(given.get("configs", ()))
        settings = BenchSettings(**given)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigurationError(f"cannot read benchmark results from {str(path)!r}: {exc}") from exc
    result = BenchResult(settings=settings, environment=data["environment"], runs=tuple(runs))
    return dataclasses.replace(result, targets=evaluate_targets(result))


def _config_from_json(c: dict[str, Any]) -> ConfigResult:
    comm = c["comm_bytes_per_step"]
    return ConfigResult(
        key=c["key"],
        label=c["label"],
        ranks=c["ranks"],
        tokens_per_step=c["tokens_per_step"],
        step=_spread_from_json(c["step_s"]),
        rank_steps=tuple(tuple(r) for r in c["step_s_per_rank"]),
        phases={name: _spread_from_json(v) for name, v in c["phases_s"].items()},
        memory=tuple(RankMemory(**{k: v for k, v in m.items() if k != "peak"}) for m in c["rss_bytes"]),
        engine_memory=c["engine_memory_bytes"],
        comm=CommVolume(
            theory=comm["theory"],
            measured=comm["measured_c10d"],
            engine=comm["measured_engine"],
            issued=comm.get("theory_as_issued_c10d"),
        ),
        first_loss=c["first_loss"],
    )


def _spread_from_json(d: dict[str, Any]) -> Spread:
    return Spread(**{**d, "samples": tuple(d["samples"])})
