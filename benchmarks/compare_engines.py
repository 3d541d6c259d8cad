"""Benchmark: shardline's strategies vs torch FSDP2 (and its HSDP) vs torch DDP vs one process.

A thin wrapper around ``shardline bench`` (:mod:`shardline.diagnostics.bench`): the same
arguments, the same files. The committed results in docs/benchmarks/ come from

    shardline bench --out docs/benchmarks        # = python benchmarks/compare_engines.py --out docs/benchmarks

See docs/benchmarks.md for the method and the discussion.
"""

from __future__ import annotations

import sys

from shardline.cli import main

if __name__ == "__main__":  # ranks start from a forkserver, which must not re-run this module's work
    sys.exit(main(["bench", *sys.argv[1:]]))
