"""The simulation's printed tables, for ``benchmarks/scale_sim.py``: the save and load columns, one row per W, in
markdown, and the report the command prints (the packed layout's table, the footnotes, each cost's slope).
"""

from __future__ import annotations

import math

from benchmarks.scale_packed import PACKED_COLUMNS
from benchmarks.scale_rows import SimulatedSave, exponents

__all__ = ["COLUMNS", "LOAD_COLUMNS", "SAVE_COLUMNS", "human", "markdown", "print_report"]

SAVE_COLUMNS = [
    ("world", "W", "{:,.0f}"),
    ("commit_rank0_s", "rank-0 commit (s)", "{:.3f}"),
    ("listing_check_s", "rank-0 listing check (s)", "{:.3f}"),
    ("build_manifest_s", "build manifest (s)", "{:.3f}"),
    ("canonical_json_s", "canonical JSON (s)", "{:.3f}"),
    ("manifest_sha256_s", "manifest SHA-256 (s)", "{:.4f}"),
    ("manifest_bytes", "manifest", "bytes"),
    ("statement_bytes", "statement", "bytes"),
    ("gathered_bytes", "gathered to rank 0 *", "bytes"),
    ("dcp_global_plan_s", "DCP global plan (s) *", "{:.1f}"),
    ("dcp_validate_s", "DCP plan validation (s) *", "{:.0f}"),
    ("shardline_validate_s", "shardline plan validation (s) *", "{:.2f}"),
    ("dcp_finish_s", "DCP finish (s) *", "{:.1f}"),
    ("dcp_metadata_bytes", ".metadata *", "bytes"),
]
LOAD_COLUMNS = [
    ("world", "W", "{:,.0f}"),
    ("metadata_open_per_rank_s", "open .metadata per rank (s) *", "{:.2f}"),
    ("load_plan_per_rank_s", "load plan per rank, torch's planner (s) *", "{:.2f}"),
    ("load_plan_fast_per_rank_s", "load plan per rank, shardline's (s) *", "{:.3f}"),
    ("load_global_plan_s", "rank-0 load global plan (s)", "{:.3f}"),
    ("resume_select_s", "resume selection (s)", "{:.3f}"),
    ("manifest_broadcast_bytes", "checked manifest, whole", "bytes"),
    ("manifest_broadcast_rank0_s", "its encoding, rank 0 (s)", "{:.3f}"),
    ("manifest_receive_per_rank_s", "its decoding, per rank (s)", "{:.3f}"),
    ("manifest_load_bytes_per_rank", "manifest to each rank at a load", "bytes"),
    ("restart_count_bytes_per_rank", "restart count to each rank", "bytes"),
    ("objects_per_prefix", "objects per prefix (max)", "{:,.0f}"),
    ("save_requests", "save requests", "{:,.0f}"),
    ("save_requests_per_prefix", "save requests per prefix (max)", "{:,.0f}"),
    ("save_floor_s", "save floor at 3,500/s per prefix (s)", "{:.1f}"),
    ("load_requests", "load requests", "{:,.0f}"),
    ("load_requests_per_prefix", "load requests per prefix (max)", "{:,.0f}"),
    ("load_floor_s", "load floor at 5,500/s per prefix (s)", "{:.1f}"),
]
COLUMNS = SAVE_COLUMNS + LOAD_COLUMNS[1:]


def human(n: float) -> str:
    """``n`` bytes in decimal units (``"1.5 MB"``)."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError


def markdown(rows: list[SimulatedSave], columns: list[tuple[str, str, str]] = COLUMNS) -> str:
    """A table of ``columns`` (one row per W); ``~``: extrapolated."""
    head = "| " + " | ".join(c[1] for c in columns) + " |"
    lines = [head, "|" + "---:|" * len(columns)]
    for r in rows:
        vals = {"world": r.world, **r.values}
        cells = []
        for key, _, form in columns:
            value = vals.get(key, math.nan)
            cells.append(
                ("~" if key in r.extrapolated else "") + (human(value) if form == "bytes" else form.format(value))
            )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def print_report(rows: list[SimulatedSave], *, layout: str) -> None:
    """Print the tables of ``rows`` (the per-tensor ones unless ``layout`` is ``packed_only``), then the footnotes
    and, over more than one W, each cost's log-log slope."""
    if layout != "packed_only":
        print(markdown(rows, SAVE_COLUMNS) + "\n\n" + markdown(rows, LOAD_COLUMNS))
    if any("packed_metadata_items" in r.values for r in rows):
        columns = PACKED_COLUMNS
        if layout == "packed_only":  # no per-tensor figures to stand beside
            columns = [c for c in columns if not c[1].startswith("per-tensor")]
        print("\npacked layout:\n\n" + markdown(rows, columns))
    print("\n~ extrapolated from the two largest W measured (--validate-max-world)")
    print("\n* scaled from the sampled tensors (--dcp-layers) to all of them by count")
    if len(rows) > 1:
        print(
            "\nlog-log slope, smallest to largest W: " + ", ".join(f"{k} {e:.2f}" for k, e in exponents(rows).items())
        )
