"""The engine benchmark's results: records, the targets verdict, JSON, Markdown tables and the PNG chart.

The measuring lives in :mod:`shardline.diagnostics.bench`; this module only holds and presents
what it measured.
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
from shardline.diagnostics.bench_settings import BenchSettings, ModelSize
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
    "plot_results",
    "prepare_out_dir",
    "render_markdown",
    "render_summary",
    "require_matplotlib",
    "to_json",
    "write_results",
]

MIB = 2**20
PHASES = ("forward", "backward", "optimizer")

SCHEMA = "shardline.bench/1"
_TARGET_HEADER = ("| target | size | value | threshold | met | detail |", "|---|---|---|---|---|---|")
_KIND_ABBREV = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR", "broadcast": "BC"}


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
    """Logical bytes per step by collective kind: theory and the two measurements."""

    theory: dict[str, int]
    measured: dict[str, int] | None  # every c10d collective, seen by a dispatch mode
    engine: dict[str, int] | None  # shardline's own count_collectives log (shardline rows)

    @property
    def matches(self) -> bool:
        """Every measurement present equals the theory, kind by kind."""
        got = [m for m in (self.measured, self.engine) if m is not None]
        return bool(got) and all(_nonzero(m) == _nonzero(self.theory) for m in got)


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

    kind: str  # "main" or "w1"
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


def evaluate_targets(result: BenchResult) -> tuple[Target, ...]:
    """The issue's targets, per size: step time and peak memory vs FSDP2, bytes vs theory, W=1 overhead."""
    targets: list[Target] = []
    for size in result.settings.sizes:
        main, w1 = result.run(size.name), result.run(size.name, "w1")
        ours = main.get("shardline_full_shard") if main else None
        fsdp2 = main.get("torch_fsdp2") if main else None
        if ours is not None and fsdp2 is not None:
            targets.append(
                Target(
                    name="FULL_SHARD step time / FSDP2",
                    size=size.name,
                    value=ours.step.median / fsdp2.step.median,
                    comparison="<=",
                    threshold=1.0,
                    detail=f"{ours.step.median * 1e3:.1f} ms vs {fsdp2.step.median * 1e3:.1f} ms (aim 0.9x)",
                )
            )
            if ours.peak_rss is not None and fsdp2.peak_rss:
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
        rows = [c for run in (main, w1) if run is not None for c in run.configs if c.key.startswith("shardline")]
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
    return tuple(targets)


# ---------------------------------------------------------------------------- environment
def require_matplotlib() -> None:
    """Fail before a long run, not after it, when the chart cannot be drawn."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise ConfigurationError(
            "the benchmark chart needs matplotlib, which is not installed: pip install 'shardline[plot]', "
            "or pass --no-plot (plot=False) to write only the JSON and Markdown results"
        ) from exc


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
        sizes = {}
        runs = []
        for run in data["runs"]:
            size = ModelSize(**{k: v for k, v in run["size"].items() if k != "num_params"})
            sizes.setdefault(size.name, size)
            configs = tuple(_config_from_json(c) for c in run["configs"])
            fields = {k: run[k] for k in ("kind", "world_size", "micro_batch", "rss_method", "wall_s")}
            runs.append(RunResult(size=size, configs=configs, **fields))
        settings = BenchSettings(**{**data["settings"], "sizes": tuple(sizes[n] for n in data["settings"]["sizes"])})
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
        comm=CommVolume(theory=comm["theory"], measured=comm["measured_c10d"], engine=comm["measured_engine"]),
        first_loss=c["first_loss"],
    )


def _spread_from_json(d: dict[str, Any]) -> Spread:
    return Spread(**{**d, "samples": tuple(d["samples"])})


# ---------------------------------------------------------------------------- Markdown
def render_markdown(result: BenchResult) -> str:
    """The results as Markdown: a summary, then per size the full table, W=1 and phase times."""
    env = result.environment
    s = result.settings
    lines = [
        "# shardline vs torch FSDP2 vs torch DDP",
        "",
        f"{env['date']} · torch {env['torch']} · shardline {env['shardline']} · {env['cpu_model']}, "
        f"{env['cpus_usable']} usable cores · gloo, {env['threads_per_rank']} thread per rank",
        "",
        f"Command: `{env['command'] or 'run_benchmark(...)'}`",
        "",
        f"{s.rounds} rounds x {s.steps} steps per configuration, alternating (order rotated each round), "
        f"after {s.warmup} warm-up steps; AdamW; micro-batch {s.micro_batch} per rank. See docs/benchmarks.md.",
        "",
        "## Summary",
        "",
        *render_summary(result),
    ]
    for run in result.runs:
        if run.kind == "main":
            lines += ["", *_main_section(run, result.run(run.size.name, "w1"))]
    if result.targets:
        lines += ["", "## Targets", "", *_TARGET_HEADER]
        for t in result.targets:
            value, threshold = f"{t.value:.3g}", f"{t.comparison} {t.threshold:g}"
            lines.append(
                f"| {t.name} | {t.size} | {value} | {threshold} | {'yes' if t.met else '**no**'} | {t.detail} |"
            )
    return "\n".join(lines) + "\n"


def render_summary(result: BenchResult) -> list[str]:
    """A compact table over all sizes (the one the README shows)."""
    lines = [
        "| model | configuration | step time, ms | tokens/s | vs FSDP2 | peak RSS/rank, MiB | bytes/step = theory |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for run in result.runs:
        if run.kind != "main":
            continue
        model = f"{run.size.name} ({run.size.num_params / 1e6:.2f} M)"
        for c in run.configs:
            lines.append(
                f"| {model} | {c.label} | {c.step.median * 1e3:.1f} | {c.tokens_per_s:,.0f} | {_ratio(c, run)} | "
                f"{_mib(c.peak_rss)} | {_equal(c)} |"
            )
        w1 = result.run(run.size.name, "w1")
        plain = w1.get("plain") if w1 else None
        for c in w1.configs if w1 else ():
            label = f"{c.label}, W=1" + (
                f" ({c.step.median / plain.step.median - 1:+.1%})" if plain and c is not plain else ""
            )
            lines.append(
                f"| {model} | {label} | {c.step.median * 1e3:.1f} | {c.tokens_per_s:,.0f} | — | "
                f"{_mib(c.peak_rss)} | {_equal(c)} |"
            )
    return lines


def _main_section(run: RunResult, w1: RunResult | None) -> list[str]:
    size = run.size
    baseline = [m.baseline for c in run.configs for m in c.memory if m.baseline is not None]
    lines = [
        f"## {size.name}: {size.describe()}",
        "",
        f"{run.world_size} ranks x micro-batch {run.micro_batch} x {size.seq_len} tokens = "
        f"{run.configs[0].tokens_per_step:,} tokens per step; run took {run.wall_s:.0f} s. "
        f"RSS ({run.rss_method}) of a process training one configuration; runtime baseline (torch, before the "
        f"model is built) {_mib(min(baseline) if baseline else None)}-{_mib(max(baseline) if baseline else None)} MiB.",
        "",
        "| configuration | step time, ms: median [IQR] | tokens/s | vs FSDP2 | peak RSS/rank, MiB "
        "| above baseline: resident + step, MiB | engine memory/rank, MiB | bytes/step measured | theory | = |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for c in run.configs:
        lines.append(
            f"| {c.label} | {_spread(c)} | {c.tokens_per_s:,.0f} | {_ratio(c, run)} | {_mib(c.peak_rss)} | {_rss(c)} "
            f"| {_engine(c)} | {_volume(c.comm.measured)} | {_volume(c.comm.theory)} | {_equal(c)} |"
        )
    lines += ["", "Median phase times, ms (each the slowest rank's):", ""]
    lines += ["| configuration | " + " | ".join(PHASES) + " | first loss |", "|---|---:|---:|---:|---:|"]
    for c in run.configs + (w1.configs if w1 else ()):
        label = f"{c.label} (W=1)" if w1 and c in w1.configs else c.label
        phases = " | ".join(f"{c.phases[p].median * 1e3:.1f}" for p in PHASES)
        lines.append(f"| {label} | {phases} | {c.first_loss:.6f} |")
    if w1 is not None:
        lines += ["", *_w1_section(w1)]
    return lines


def _w1_section(run: RunResult) -> list[str]:
    lines = [
        f"One rank, the global batch ({run.micro_batch} x {run.size.seq_len} tokens), alternating:",
        "",
        "| configuration (W=1) | step time, ms: median [IQR] | tokens/s | peak RSS, MiB "
        "| above baseline: resident + step, MiB | overhead |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    plain = run.get("plain")
    for c in run.configs:
        overhead = f"{c.step.median / plain.step.median - 1:+.1%}" if plain and c is not plain else "—"
        lines.append(
            f"| {c.label} | {_spread(c)} | {c.tokens_per_s:,.0f} | {_mib(c.peak_rss)} | {_rss(c)} | {overhead} |"
        )
    return lines


def _spread(c: ConfigResult) -> str:
    return f"{c.step.median * 1e3:.1f} [{c.step.p25 * 1e3:.1f}-{c.step.p75 * 1e3:.1f}]"


def _ratio(c: ConfigResult, run: RunResult) -> str:
    fsdp2 = run.get("torch_fsdp2")
    return f"{c.step.median / fsdp2.step.median:.2f}x" if fsdp2 else "—"


def _mib(value: int | None) -> str:
    return "n/a" if value is None else f"{value / MIB:.1f}"


def _rss(c: ConfigResult) -> str:
    worst = c.worst_rank
    if worst is None or worst.peak is None:
        return "n/a"
    return f"{_mib(worst.peak)} = {_mib(worst.state)} + {_mib(worst.step)}"


def _engine(c: ConfigResult) -> str:
    m = c.engine_memory
    if m is None:
        return "—"
    state = m["sharded_params"] + m["sharded_grads"] + m["optimizer_state"]
    peak = m["peak_unsharded_params"] + m["peak_comm_buffers"]
    return f"{state / MIB:.2f} + {peak / MIB:.2f} peak"


def _volume(volume: dict[str, int] | None) -> str:
    if volume is None:
        return "not measured"
    parts = {k: v for k, v in volume.items() if v}
    if not parts:
        return "0"
    detail = " + ".join(f"{_KIND_ABBREV.get(k, k)} {v / MIB:.2f}" for k, v in parts.items())
    return f"{sum(parts.values()) / MIB:.2f} MiB ({detail})" if len(parts) > 1 else f"{detail} MiB"


def _equal(c: ConfigResult) -> str:
    return "yes" if c.comm.matches else "**no**"


# ---------------------------------------------------------------------------- PNG
_COLORS = {
    "shardline_full_shard": "#1f4e9c",
    "shardline_shard_grad_op": "#4a7fd4",
    "shardline_no_shard": "#8fb3ea",
    "torch_fsdp2": "#d9822b",
    "torch_ddp": "#e8b04a",
    "one_process": "#8a8a8a",
}


def plot_results(result: BenchResult, *, path: str | Path) -> Path:
    """Grouped bars of median step time per configuration, one panel per size, FSDP2 as reference."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in result.runs if r.kind == "main"]
    fig, axes = plt.subplots(1, len(runs), figsize=(5.2 * len(runs), 4.6), squeeze=False)
    for ax, run in zip(axes[0], runs, strict=True):
        medians = [c.step.median * 1e3 for c in run.configs]
        errors = [
            [(c.step.median - c.step.p25) * 1e3 for c in run.configs],
            [(c.step.p75 - c.step.median) * 1e3 for c in run.configs],
        ]
        xs = range(len(run.configs))
        colors = [_COLORS.get(c.key, "#555555") for c in run.configs]
        ax.bar(xs, medians, yerr=errors, color=colors, capsize=3)
        fsdp2 = run.get("torch_fsdp2")
        if fsdp2 is not None:
            ax.axhline(fsdp2.step.median * 1e3, color=_COLORS["torch_fsdp2"], linestyle="--", linewidth=1)
            for x, c in zip(xs, run.configs, strict=True):
                ax.annotate(
                    f"{c.step.median / fsdp2.step.median:.2f}x",
                    (x, c.step.p75 * 1e3),
                    textcoords="offset points",
                    xytext=(0, 3),
                    ha="center",
                    fontsize=8,
                )
        ax.set_xticks(list(xs), [c.label for c in run.configs], fontsize=8, rotation=30, ha="right")
        ax.set_ylabel("step time, ms (median, IQR)")
        ax.set_title(f"{run.size.name}: {run.size.num_params / 1e6:.2f} M params, {run.world_size} ranks", fontsize=10)
        ax.margins(y=0.12)
    env = result.environment
    fig.suptitle(f"Step time vs torch FSDP2 (dashed) — torch {env['torch']}, {env['cpu_model']}, gloo", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------- files
def prepare_out_dir(out_dir: str | Path) -> Path:
    """Create ``out_dir`` and check that it is writable (before a long run, not after it)."""
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".shardline-bench-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise ConfigurationError(
            f"cannot write results into {str(out)!r}: {exc}. Pick a writable directory for --out."
        ) from exc
    return out


def write_results(result: BenchResult, *, out_dir: str | Path, plot: bool = True) -> list[Path]:
    """Write ``results.json``, ``results.md`` and (with ``plot``) ``results.png`` into ``out_dir``."""
    out = prepare_out_dir(out_dir)
    written = [out / "results.json", out / "results.md"]
    written[0].write_text(json.dumps(to_json(result), indent=2) + "\n")
    written[1].write_text(render_markdown(result))
    if plot:
        written.append(plot_results(result, path=out / "results.png"))
    return written
