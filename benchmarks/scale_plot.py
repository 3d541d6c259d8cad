"""The simulation's plot, for ``benchmarks/scale_sim.py``: each cost against W on log-log axes."""

from __future__ import annotations

from pathlib import Path

from benchmarks.scale_rows import SimulatedSave

__all__ = ["PLOT_PACKED_SECONDS", "PLOT_PACKED_SIZES", "PLOT_SECONDS", "PLOT_SIZES", "plot"]

PLOT_SECONDS = [
    ("commit_rank0_s", "rank-0 commit"),
    ("manifest_sha256_s", "manifest SHA-256"),
    ("resume_select_s", "resume selection"),
    ("listing_check_s", "rank-0 listing check"),
    ("manifest_receive_per_rank_s", "checked manifest received, per rank"),
    ("load_global_plan_s", "rank-0 load global plan"),
    ("dcp_global_plan_s", "DCP global plan *"),
    ("dcp_validate_s", "DCP plan validation *"),
    ("shardline_validate_s", "shardline plan validation *"),
    ("dcp_finish_s", "DCP finish *"),
    ("metadata_open_per_rank_s", "open .metadata, per rank *"),
    ("load_plan_per_rank_s", "load plan, per rank, torch's planner *"),
    ("load_plan_fast_per_rank_s", "load plan, per rank, shardline's *"),
]
PLOT_SIZES = [
    ("manifest_bytes", "manifest (bytes)"),
    ("statement_bytes", "statement (bytes)"),
    ("gathered_bytes", "gathered to rank 0 (bytes) *"),
    ("dcp_metadata_bytes", ".metadata (bytes) *"),
    ("objects_per_prefix", "objects per prefix (max)"),
    ("save_requests", "object-store requests of a save"),
]
PLOT_PACKED_SECONDS = [
    ("packed_global_plan_s", "packed: rank-0 global plan + check"),
    ("packed_finish_s", "packed: DCP finish"),
    ("packed_metadata_open_per_rank_s", "packed: open .metadata, per rank"),
    ("packed_load_plan_per_rank_s", "packed: load plan, per rank"),
]
PLOT_PACKED_SIZES = [
    ("packed_metadata_bytes", "packed: .metadata (bytes)"),
    ("packed_gathered_bytes", "packed: gathered to rank 0 (bytes)"),
]
"""The packed layout's series (``--layout packed``), dashed beside the per-tensor ones."""


def plot(rows: list[SimulatedSave], path: Path) -> Path:
    """Cost vs W on log-log axes: seconds (left; the one-second line dashed), sizes and counts (right)."""
    from shardline.diagnostics.bench.render import require_matplotlib

    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 6))
    worlds = [r.world for r in rows]
    panels = ((left, PLOT_SECONDS, PLOT_PACKED_SECONDS), (right, PLOT_SIZES, PLOT_PACKED_SIZES))
    for ax, per_tensor, packed in panels:
        series = [(key, label, "-") for key, label in per_tensor] + [(key, label, "--") for key, label in packed]
        for key, label, style in series:
            points = [(r.world, r.values[key]) for r in rows if r.values.get(key, 0) > 0 and key not in r.extrapolated]
            guessed = [(r.world, r.values[key]) for r in rows if key in r.extrapolated and r.values.get(key, 0) > 0]
            if not points:
                continue
            (line,) = ax.plot(*zip(*points, strict=True), style, marker="o", markersize=3, label=label)
            if guessed:  # extrapolated: dotted, from the last measured point
                ax.plot(*zip(points[-1], *guessed, strict=True), linestyle=":", color=line.get_color())
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(worlds, [f"{w:,}" for w in worlds])
        ax.set_xlabel("ranks W (8 files each)")
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=6.5, loc="upper left")
    left.axhline(1.0, color="black", linestyle="--", linewidth=0.8)
    left.set_ylabel("CPU seconds (one core)")
    right.set_ylabel("bytes / count")
    left.set_title("time: rank 0, or every rank (per rank)", fontsize=10)
    right.set_title("sizes and object-store counts", fontsize=10)
    fig.suptitle(
        "shardline's checkpoint protocol at W ranks, simulated (70B Llama, FULL_SHARD); * scaled from sampled "
        "tensors, dotted: extrapolated; dashed: the packed layout",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
