"""The engine benchmark's results as Markdown tables and a PNG chart, and the files they are written to."""

from __future__ import annotations

import json
from pathlib import Path

from shardline.diagnostics.bench.results import MIB, PHASES, BenchResult, ConfigResult, RunResult, to_json
from shardline.errors import ConfigurationError

__all__ = [
    "plot_results",
    "prepare_out_dir",
    "render_markdown",
    "render_summary",
    "require_matplotlib",
    "write_results",
]

_TARGET_HEADER = ("| target | size | value | threshold | met | detail |", "|---|---|---|---|---|---|")
_KIND_ABBREV = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR", "broadcast": "BC"}


def require_matplotlib() -> None:
    """Fail before a long run, not after it, when the chart cannot be drawn."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise ConfigurationError(
            "the benchmark chart needs matplotlib, which is not installed: pip install 'shardline[plot]', "
            "or pass --no-plot (plot=False) to write only the JSON and Markdown results"
        ) from exc


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
        elif run.kind == "hybrid":
            lines += ["", *_hybrid_section(run)]
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
        if run.kind == "w1":
            continue
        model = f"{run.size.name} ({run.size.num_params / 1e6:.2f} M)"
        if run.kind == "hybrid":
            model += f", {run.world_size} ranks"
        for c in run.configs:
            lines.append(
                f"| {model} | {c.label} | {c.step.median * 1e3:.1f} | {c.tokens_per_s:,.0f} | {_ratio(c, run)} | "
                f"{_mib(c.peak_rss)} | {_equal(c)} |"
            )
        w1 = result.run(run.size.name, "w1") if run.kind == "main" else None
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


def _hybrid_section(run: RunResult) -> list[str]:
    size = run.size
    lines = [
        f"## {size.name}, hybrid sharding: {run.world_size} ranks on a 2x2 (replicate, shard) mesh",
        "",
        f"{run.world_size} ranks x micro-batch {run.micro_batch} x {size.seq_len} tokens; run took {run.wall_s:.0f} s. "
        "Both shard each block over 2 ranks and all-reduce gradients across the 2 replicas.",
        "",
        "| configuration | step time, ms: median [IQR] | tokens/s | vs FSDP2 HSDP | peak RSS/rank, MiB "
        "| engine memory/rank, MiB | bytes/step measured | theory | = |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for c in run.configs:
        lines.append(
            f"| {c.label} | {_spread(c)} | {c.tokens_per_s:,.0f} | {_ratio(c, run)} | {_mib(c.peak_rss)} "
            f"| {_engine(c)} | {_volume(c.comm.measured)} | {_volume(c.comm.theory)} | {_equal(c)} |"
        )
    phases = " / ".join(PHASES)
    lines += ["", f"Median phase times, ms ({phases}):", ""]
    for c in run.configs:
        lines.append(f"- {c.label}: " + " / ".join(f"{c.phases[p].median * 1e3:.1f}" for p in PHASES))
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


def _peer(run: RunResult) -> ConfigResult | None:
    """The FSDP2 configuration of a run: plain FSDP2, or HSDP in the hybrid run."""
    return run.get("torch_fsdp2") or run.get("torch_fsdp2_hsdp")


def _ratio(c: ConfigResult, run: RunResult) -> str:
    fsdp2 = _peer(run)
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
    "shardline_shard_opt": "#6a9be0",
    "shardline_hybrid_shard": "#1f4e9c",
    "torch_fsdp2": "#d9822b",
    "torch_fsdp2_hsdp": "#d9822b",
    "torch_ddp": "#e8b04a",
    "one_process": "#8a8a8a",
}


def plot_results(result: BenchResult, *, path: str | Path) -> Path:
    """Grouped bars of median step time per configuration, one panel per size, FSDP2 as reference."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in result.runs if r.kind in ("main", "hybrid")]
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
        fsdp2 = _peer(run)
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
