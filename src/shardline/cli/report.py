"""``shardline report``: argument parsing for :func:`shardline.report.write_report`."""

from __future__ import annotations

import argparse
import sys

from shardline.cli.common import add_storage_options, row_count, storage_options
from shardline.errors import ShardlineError

__all__ = ["register"]


def _cmd_report(args: argparse.Namespace) -> int:
    from shardline.report.collect import Status
    from shardline.report.html import write_report

    try:
        path, facts = write_report(
            args.run_dir,
            out=args.out,
            public_key=args.public_key,
            storage_options=storage_options(args),
            limit=args.limit,
        )
    except (ShardlineError, OSError) as e:  # a bad path or an unwritable --out: nothing was checked
        print(f"error: {e}", file=sys.stderr)
        return 2
    bad = [c.name for c in facts.checkpoints if c.status in (Status.FAILED, Status.MOVED)]
    broken = facts.lineage is None or not facts.lineage.ok
    print(
        f"Wrote {path}: {len(facts.checkpoints)} checkpoint(s), "
        f"{sum(c.status == Status.VERIFIED for c in facts.checkpoints)} verified, "
        f"{sum(c.status == Status.DELETED for c in facts.checkpoints)} deleted by retention"
        + (f"; NOT verified: {', '.join(bad)}" if bad else "")
        + ("; the lineage chain does NOT verify" if broken else "; the lineage chain verifies")
        + "."
    )
    return 1 if bad or broken else 0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``report`` to the ``shardline`` command."""
    report = subparsers.add_parser(
        "report", help="write one self-contained HTML page about a run for a reviewer (verifies every checkpoint)"
    )
    report.add_argument("run_dir", help="run directory (holding lineage.sqlite, or checkpoints/lineage.sqlite)")
    report.add_argument("--out", metavar="FILE.html", help="where to write the page (default: RUN_DIR/report.html)")
    report.add_argument(
        "--public-key", metavar="PUB.pem", help="also check each checkpoint's signature (CKPT.sig) with this key"
    )
    report.add_argument(
        "--limit",
        metavar="N",
        type=row_count,
        help="show the newest N checkpoints in detail and count the older ones (every one is checked either way)",
    )
    add_storage_options(report)
    report.set_defaults(func=_cmd_report)
