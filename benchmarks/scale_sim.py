"""Simulator: shardline's checkpoint protocol at W ranks, run in one process with shardline's own code.

What each rank's transport would carry is built as the objects DCP gathers or scatters (no
process group, no data written): each rank's data files are replaced by their sizes and stand-in
digests, and the state dict is a 70B Llama's tensors (names and shapes from the published config:
80 layers, hidden 8192, intermediate 28672, 64 heads, 8 KV heads, vocab 128256; fp32 weights and
two Adam moments) sharded FULL_SHARD (``benchmarks/scale_layout.py``). Per W it runs and times:

* **Commit (rank 0)**: ``hashing_writer.split_digests`` over every rank's gathered write results
  (the digest records of ``files`` files per rank), then the save's ``_records`` (provenance
  statement, ``build_manifest``, canonical JSON, SHA-256) and ``render_sums``; each piece is also
  timed on its own. ``bytes gathered`` is the pickled size of every rank's write results (DCP's
  ``gather_object``): the digest records plus DCP's own per-item results.
* **DCP planning**: torch's ``DefaultSavePlanner.create_global_plan`` over W local plans of
  ``WriteItem`` chunks, and ``.metadata`` as ``FileSystemWriter.finish`` pickles it. The plan's
  validation is timed twice: torch's ``_validate_global_plan`` (quadratic for some tensors, run up
  to ``--validate-max-world``) and shardline's save planner's (``plan_validation.py``, every W).
* **Load planning**: every rank's check and unpickling of ``.metadata`` (``opening.py``: SHA-256, then
  ``dcp_io.unpickle_metadata``), one rank's read plan against that metadata twice -- torch's
  resharding planner (``create_read_items_for_chunk_list``, what every rank ran before) and
  shardline's ``ShardlineLoadPlanner`` (each piece found by its offsets and sizes; the same items,
  checked) -- and rank 0's global plan in shardline's ``VerifyingReader.prepare_global_plan``
  (which rank hashes which file).
* **Resume selection**: ``resume.find_candidates`` over a directory of ``--keep`` committed
  checkpoints of W ranks and a 1,000-row ledger.
* **Beside those** (``benchmarks/scale_side_costs.py``): rank 0's listing check before the commit (a real
  directory of W x ``files`` empty files), the whole checked manifest (its bytes, rank 0's encoding, each
  rank's decoding), what of it each rank receives at a load, and the elastic restart's restart count.
* **Packed layout** (``--layout packed``, ``benchmarks/scale_packed.py``): the save planner's packed
  code at W -- rank 0's table build, a rank's local plan, rank 0's global plan with metadata and
  plan check, ``.metadata``'s items and pickled size -- printed beside the per-tensor figures.
* **Object store**: the requests a save and a verified load make under the checkpoint's prefixes,
  counted from the store's operations (claim, multipart uploads in s3fs's 50 MiB parts, records; computed,
  not sent), and the floor they put on the save at S3's documented 3,500 PUT/s and 5,500 GET/s per prefix:
  the data files under ``shards/GGGG/`` as a bucket save spreads them (256 ranks a prefix,
  ``key_prefixes.py``), so the fullest prefix sets the floor (the data files' names elsewhere are the
  flat ones of a local save).

Note: the DCP pieces scale with the number of tensors times W (35M chunks at W=16,384), more than
one process here can hold, so they run on ``--dcp-layers`` decoder layers (default 1: with the
embedding, final norm and head, 36 of the 2,169 tensors) and are scaled to all tensors by their
count (each tensor's planning is independent of the others'); columns so scaled are marked in the
table. Everything shardline gathers or writes per file runs at full size.
The ledger over many saves is ``benchmarks/scale_ledger.py``.

    python -m benchmarks.scale_sim [--worlds 8,64,512,1024,4096,16384] [--files 8] [--json out.json]
        [--plot docs/benchmarks/scale.png] [--layout packed]
    python -m benchmarks.scale_sim --from-json out.json --plot docs/benchmarks/scale.png   # redraw only

The pieces: ``scale_measure.py`` (one W's measurements), ``scale_capture.py`` and ``scale_dcp.py`` (the simulated
ranks' capture, digests and DCP plans), ``scale_requests.py`` (object-store requests), ``scale_rows.py`` (rows,
extrapolation, slopes, ``--json``), ``scale_table.py`` (the printed tables), ``scale_plot.py`` (the plot).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from benchmarks.scale_layout import LLAMA_70B, state_dict_keys
from benchmarks.scale_measure import simulate, timed
from benchmarks.scale_packed import packed_costs
from benchmarks.scale_plot import plot
from benchmarks.scale_requests import object_store_requests
from benchmarks.scale_rows import SimulatedSave, exponents, extrapolate, load_rows, save_rows
from benchmarks.scale_table import markdown, print_report

__all__ = ["WORLDS", "SimulatedSave", "exponents", "main", "markdown", "simulate"]

WORLDS = (8, 64, 512, 1024, 4096, 16384)
_object_store = object_store_requests  # the name tests/test_scale_sim.py calls


def main(argv: list[str] | None = None) -> int:
    """The command line: measure each W (or read an earlier ``--json``), print the tables, write the JSON and plot."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default=",".join(map(str, WORLDS)), help="comma-separated world sizes")
    parser.add_argument("--files", type=int, default=8, help="data files per rank")
    parser.add_argument("--layers", type=int, default=LLAMA_70B.layers)
    parser.add_argument("--dcp-layers", type=int, default=1, help="decoder layers the DCP pieces run on (scaled)")
    parser.add_argument("--keep", type=int, default=3, help="committed checkpoints resume selection chooses from")
    parser.add_argument(
        "--validate-max-world", type=int, default=4096, help="largest W whose DCP plan validation (quadratic) runs"
    )
    parser.add_argument(
        "--layout",
        choices=("per_tensor", "packed", "packed_only"),
        default="per_tensor",
        help="packed: also the packed layout's planning; packed_only: only that (seconds, even at 16,384 ranks)",
    )
    parser.add_argument("--json", type=Path, help="write the measurements here")
    parser.add_argument("--plot", type=Path, help="draw cost vs W (log-log) into this PNG (needs matplotlib)")
    parser.add_argument("--from-json", type=Path, help="print and plot the rows of an earlier --json; run nothing")
    args = parser.parse_args(argv)
    if args.plot is not None:
        from shardline.diagnostics.bench.render import require_matplotlib

        require_matplotlib()  # before a long run, not after it
    rows = load_rows(args.from_json) if args.from_json else []
    for w in [] if args.from_json else (int(x) for x in args.worlds.split(",")):
        t = time.perf_counter()
        if args.layout == "packed_only":
            packed = packed_costs(
                w, state_dict_keys(layers=args.layers), timed=timed, reps=3 if w <= 1024 else 1, files=args.files
            )
            rows.append(SimulatedSave(world=w, files=args.files, values=packed))
            continue
        rows.append(
            simulate(
                w,
                files=args.files,
                layers=args.layers,
                dcp_layers=args.dcp_layers,
                keep=args.keep,
                validate_max_world=args.validate_max_world,
                layout=args.layout,
            )
        )
        print(f"W={w}: {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
    extrapolate(rows)
    print_report(rows, layout=args.layout)
    if args.json and not args.from_json:
        save_rows(rows, args.json)
    if args.plot is not None:
        print(f"\nplot: {plot(rows, args.plot)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
