"""Simulator, second half: the lineage ledger over many saves, with shardline's own code.

Two measurements, each on a temporary run directory:

* **Growth per save at W ranks** (:func:`ledger_growth`): ``--saves`` consecutive saves of a
  W-rank checkpoint, each as the manager records it: the checkpoint's commit records on disk
  (its manifest and provenance statement, built by the save's own ``_records`` for W ranks x
  ``files`` files; no data files), its commit row (``records.record_commit``), then
  ``retention.apply_retention`` with ``keep_last_n`` (which deletes the oldest and appends its
  tombstone row). Reports the ledger's bytes per save and the record-and-retention time of the first save
  that deletes one and of the last.
* **A long ledger** (:func:`ledger_scan`): a ledger of R rows (commit and tombstone rows of
  small checkpoints, appended through ``records``), then the time of ``shardline lineage`` (the
  CLI, output discarded; and with ``--limit 20``), of resume selection (``resume.find_candidates``), of the HTML
  report's collection (``report.collect.collect_run``; only up to ``--report-max-rows``, extrapolated beyond
  and marked ``~``), and of one more save's commit row and retention over that ledger.

Times are CPU seconds of this process (``time.process_time``): every piece is one thread, so on an idle core
they are the wall time, and on a shared machine they leave out the neighbours' share.

    python -m benchmarks.scale_ledger [--worlds 8,1024,16384] [--saves 20] [--rows 1000,10000,100000]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.scale_capture import captured_checkpoint, rank_digests
from benchmarks.scale_layout import state_dict_keys
from shardline.checkpoint.integrity.hashing import FileDigest
from shardline.checkpoint.integrity.manifest import MANIFEST, MANIFEST_HASH_FILE, render_manifest_hash_file
from shardline.checkpoint.lifecycle.commit_records import build_records
from shardline.checkpoint.lifecycle.resume import find_candidates
from shardline.checkpoint.lifecycle.save import CheckpointInfo
from shardline.checkpoint.provenance.ledger import Ledger
from shardline.checkpoint.provenance.records import record_commit, record_tombstone
from shardline.checkpoint.provenance.retention import RetentionPolicy, apply_retention
from shardline.checkpoint.provenance.statement import STATEMENT_FILE
from shardline.checkpoint.storage.stores import locate
from shardline.cli.main import main as cli_main
from shardline.report.collect import collect_run

__all__ = ["ledger_growth", "ledger_scan", "main"]

_FAST = "/dev/shm" if os.path.isdir("/dev/shm") else None  # filling a long ledger: fsyncs cost nothing there


class _Run:
    """A run directory whose saves are recorded the way the manager records them (commit row, then retention)."""

    def __init__(self, root: Path, world: int, files: int, keep_last: int) -> None:
        self.root = root
        self.directory = root / "checkpoints"
        self.directory.mkdir(parents=True)
        self.ledger = Ledger(root / "lineage.sqlite")
        self.policy = RetentionPolicy(keep_last_n=keep_last)
        self.world = world
        tensors = state_dict_keys(layers=1)  # the layers change only the sizes recorded, not the rows
        self.digests: list[FileDigest] = [d for r in range(world) for d in rank_digests(tensors, world, r, files)]
        self.tensors = tensors
        self.parent: str | None = None
        self.live: list[CheckpointInfo] = []

    def save(self, step: int, *, retention: bool = True) -> float:
        """Write step ``step``'s commit records, record it, apply retention; the seconds of the last two."""
        final = self.directory / f"step-{step}"
        captured = captured_checkpoint(final, self.world, self.tensors, 1)
        captured = dataclasses.replace(captured, parent_manifest_hash=self.parent)
        made = build_records(captured, self.digests)
        statement, statement_digest, listed, manifest, digest = made[:5]
        final.mkdir()
        (final / STATEMENT_FILE).write_bytes(statement)
        (final / MANIFEST).write_bytes(manifest)
        (final / MANIFEST_HASH_FILE).write_bytes(render_manifest_hash_file(digest))
        info = CheckpointInfo(
            path=locate(final),
            step=step,
            manifest_hash=digest,
            tag=None,
            kind="sharded",
            world_size=self.world,
            files=len(listed),
            total_bytes=sum(d.bytes for d in listed),
            parent_manifest_hash=self.parent,
            provenance_sha256=statement_digest,
        )
        self.parent = digest
        t = time.process_time()
        record_commit(self.ledger, info, recovered=False)
        if retention:
            apply_retention(
                directory=locate(self.directory),
                ledger=self.ledger,
                policy=self.policy,
                just_committed=info.path,
                rel=self.ledger.name_of,
            )
        else:  # the same rows without retention's reading of the whole ledger (to fill a long one quickly)
            self.live.append(info)
            if self.policy.keep_last_n and len(self.live) > self.policy.keep_last_n:
                old = self.live.pop(0)
                shutil.rmtree(old.path)
                name = self.ledger.name_of(old.path)
                held = {"files": old.files, "bytes": old.total_bytes, "provenance_sha256": old.provenance_sha256}
                record_tombstone(self.ledger, of=old, checkpoint=name, reason="retention", held=held,
                                 keep_last_n=self.policy.keep_last_n, newer=self.ledger.name_of(info.path))  # fmt: skip
        return time.process_time() - t


def ledger_growth(world: int, *, saves: int = 20, files: int = 8, keep_last: int = 3) -> dict[str, float]:
    """Ledger bytes per save and the record-and-retention seconds of the first deleting save and the last."""
    with tempfile.TemporaryDirectory() as tmp:
        run = _Run(Path(tmp), world, files, keep_last)
        sizes, times = [], []
        for n in range(1, saves + 1):
            times.append(run.save(n * 100))
            sizes.append(run.ledger.path.stat().st_size)
        settled = sizes[keep_last:]  # from the first deletion on, each save adds a commit and a tombstone row
        per_save = (settled[-1] - settled[0]) / max(1, len(settled) - 1)
        return {"world": world, "ledger_bytes_per_save": per_save, "ledger_after_1000_saves": per_save * 1000,
                "first_deletion_s": times[keep_last], "last_save_s": times[-1]}  # fmt: skip


def ledger_scan(rows: int, *, report: bool, keep_last: int = 3) -> dict[str, float]:
    """Times of ``shardline lineage``, resume selection and the report's collection over ``rows`` ledger rows.

    ``keep_last``: the checkpoints kept on disk (0: every one, a commit row each and no tombstones).
    """
    with tempfile.TemporaryDirectory(dir=_FAST) as tmp:
        root = Path(tmp)
        run = _Run(root, 8, 1, keep_last)
        saves = (rows + keep_last) // 2 if keep_last else rows  # a commit row per save, then a tombstone per save
        for n in range(1, saves + 1):
            run.save(n * 100, retention=False)
        out: dict[str, float] = {"rows": len(run.ledger.rows()), "ledger_bytes": run.ledger.path.stat().st_size}
        t = time.process_time()
        with contextlib.redirect_stdout(io.StringIO()):
            code = cli_main(["lineage", str(root)])
        out["lineage_s"] = time.process_time() - t
        assert code == 0, f"shardline lineage exited {code}"
        t = time.process_time()
        with contextlib.redirect_stdout(io.StringIO()):
            code = cli_main(["lineage", str(root), "--limit", "20"])  # a page: the chain is still verified whole
        out["lineage_page_s"] = time.process_time() - t
        assert code == 0, f"shardline lineage --limit 20 exited {code}"
        t = time.process_time()
        found = find_candidates("auto", directory=locate(run.directory), ledger=run.ledger)
        out["resume_select_s"] = time.process_time() - t
        assert len(found.committed) == len(run.live), found
        if report:
            t = time.process_time()
            facts = collect_run(root)
            out["report_collect_s"] = time.process_time() - t
            assert facts.lineage is not None, facts.lineage_error
            assert facts.lineage.ok, facts.lineage
        out["save_retention_s"] = run.save((saves + 1) * 100)  # one more save: its commit row, then retention
        return out


def _extrapolate(rows: list[dict[str, Any]], key: str) -> None:
    have = [r for r in rows if key in r]
    for r in rows:
        if key not in r and len(have) >= 2:
            a, b = have[-2], have[-1]
            slope = math.log(b[key] / a[key]) / math.log(b["rows"] / a["rows"])
            r[key] = b[key] * (r["rows"] / b["rows"]) ** slope
            r.setdefault("extrapolated", []).append(key)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="8,1024,16384", help="world sizes of the growth measurement")
    parser.add_argument("--saves", type=int, default=12, help="consecutive saves per world size")
    parser.add_argument("--rows", default="1000,10000,100000", help="ledger lengths of the scan measurement")
    parser.add_argument("--report-max-rows", type=int, default=2000, help="longest ledger the report collects")
    args = parser.parse_args(argv)
    print("| W | ledger bytes per save | ledger after 1,000 saves | record + retention (s): first deletion | "
          f"save {args.saves} |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|")
    for w in (int(x) for x in args.worlds.split(",")):
        g = ledger_growth(w, saves=args.saves)
        print(f"| {w:,} | {g['ledger_bytes_per_save']:,.0f} | {g['ledger_after_1000_saves'] / 1e9:.2f} GB | "
              f"{g['first_deletion_s']:.3f} | {g['last_save_s']:.3f} |", flush=True)  # fmt: skip
    scans = []
    for n in (int(x) for x in args.rows.split(",")):
        t = time.perf_counter()
        scans.append(ledger_scan(n, report=n <= args.report_max_rows))
        print(f"rows={n}: {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
    _extrapolate(scans, "report_collect_s")
    print("\n| ledger rows | ledger bytes | `shardline lineage` (s) | `lineage --limit 20` (s) | resume selection (s) "
          "| report collection (s) | next save: record + retention (s) |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for s in scans:
        mark = "~" if "report_collect_s" in s.get("extrapolated", []) else ""
        print(f"| {s['rows']:,} | {s['ledger_bytes'] / 1e6:.1f} MB | {s['lineage_s']:.2f} | {s['lineage_page_s']:.2f} "
              f"| {s['resume_select_s']:.3f} "
              f"| {mark}{s['report_collect_s']:.1f} | {s['save_retention_s']:.3f} |")  # fmt: skip
    print(f"\n~ extrapolated from the two longest ledgers collected; load average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
