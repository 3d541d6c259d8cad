"""The physical floor of a checkpoint operation on this machine: what no hashing implementation can beat.

Note: how the floor is defined (for a save; a load is the same with plain DCP's load). A
verified save does plain DCP's work plus one SHA-256 pass over the rank's bytes, so it cannot
end before any of:

* the plain save itself (``plain_s``);
* all the CPU work on the cores the rank may use: ``(plain_cpu_s + hash_one_thread_s) / cores``
  (plain's CPU time -- its copies into the page cache, its pickling -- plus the hash, spread
  perfectly; with one core per rank this is plain's CPU time plus the whole hash);
* the hash itself on the threads that can hash the rank's files at once (``hash_parallel_s``,
  measured with ``min(files, cores)`` threads).

The floor is the largest of the three. Where it is the plain save (the hash fits in the time
and cores plain leaves idle), the target is the plain save (1.03x); elsewhere it is 5% above the
floor. The floor is a lower bound, not a promise: it assumes perfect overlap.

Note: the durable floor (:func:`durable_floor_s`). The floor above counts none of what a lineage
save does once per save whatever its size, which plain DCP does not do at all, so at a small
checkpoint it says nothing about those. What a lineage save cannot skip (:func:`fixed_cost`),
timed in the same run on the same storage:

* its manifest made durable: a small file written and fsynced, renamed into place, and the
  directory fsynced (the commit point needs it);
* at W>1, one round trip of the process group (a barrier): the ranks must learn the outcome;
* with ``ledger=True`` (a save that records its row: ``CheckpointManager.save``), one SQLite
  commit with the ledger's settings (``journal_mode=DELETE``, ``synchronous=FULL``).
  ``shardline.checkpoint.save`` records no row, so its durable floor leaves the ledger out.

The durable floor is the floor plus that fixed term: still a lower bound (a real save also writes
the provenance statement and the hash files, and agrees with the ranks before the write).

Note: the verification floor of a load (:func:`verification_floor_s`). A verified load's floor
(plain's load, the CPU work plus one SHA-256 pass, the hash on its threads) likewise counts none of
the fixed work verification adds once per load, which plain DCP's load does not do. What it cannot
skip (:func:`load_fixed_cost`), timed in the same run on the same checkpoint: rank 0 reads
``manifest.json`` and hashes it (the anchor: nothing is trusted before it), and at W>1 one round
trip of the process group (the checked manifest reaching the other ranks; the data's verdict rides
in DCP's own read all-gather). A lower bound too: a real load also reads the hash files, lists
the directory, hashes ``.metadata`` on every rank and agrees once more after installing.
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
import statistics
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch.distributed as dist

__all__ = [
    "FixedCost",
    "LoadFixedCost",
    "durable_floor_s",
    "fixed_cost",
    "floor_s",
    "hash_in_parallel",
    "interval",
    "load_fixed_cost",
    "median_ratio",
    "round_trip_s",
    "verification_floor_s",
]


@dataclass(frozen=True)
class FixedCost:
    """One measurement of a lineage save's per-save fixed work (see the module note), in seconds."""

    manifest_s: float
    """Write and fsync a small file, rename it into place, fsync the directory."""
    ledger_s: float
    """One SQLite commit (one row) with the ledger's settings."""
    round_trip_s: float
    """One barrier of the process group (0 at W=1)."""

    def total_s(self, *, ledger: bool) -> float:
        """The fixed term: the manifest, the round trip, and the ledger commit where the save records a row."""
        return self.manifest_s + self.round_trip_s + (self.ledger_s if ledger else 0.0)


def floor_s(
    *, plain_s: float, plain_cpu_s: float, hash_one_thread_s: float, hash_parallel_s: float, cores: int
) -> float:
    """The floor of one rep (see the module note)."""
    return max(plain_s, (plain_cpu_s + hash_one_thread_s) / max(1, cores), hash_parallel_s)


def durable_floor_s(*, floor: float, fixed: FixedCost, ledger: bool) -> float:
    """The durable floor of one rep: :func:`floor_s`'s floor plus the fixed term (see the module note)."""
    return floor + fixed.total_s(ledger=ledger)


def round_trip_s() -> float:
    """Seconds of one barrier of the default process group (every rank calls it; 0 without one, or at W=1)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return 0.0
    dist.barrier()  # the ranks arrive together: the timed one is a round trip, not a wait for a late rank
    started = time.perf_counter()
    dist.barrier()
    return time.perf_counter() - started


def _manifest_s(directory: Path, size: int) -> float:
    data = os.urandom(size)
    final = directory / "manifest.json"
    tmp = directory / ".manifest.json.tmp"
    started = time.perf_counter()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, final)
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return time.perf_counter() - started


def _ledger_s(directory: Path) -> float:
    conn = sqlite3.connect(directory / "ledger.db", isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode=DELETE")
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("CREATE TABLE IF NOT EXISTS rows (id INTEGER PRIMARY KEY, body TEXT)")
        body = "x" * 512  # about one commit row
        started = time.perf_counter()
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("INSERT INTO rows (body) VALUES (?)", (body,))
        conn.execute("COMMIT")
        return time.perf_counter() - started
    finally:
        conn.close()


def fixed_cost(directory: Path, *, manifest_bytes: int = 4096) -> FixedCost:
    """Time a lineage save's fixed work once, in a fresh directory under ``directory`` (removed after), on rank 0;
    and one barrier of the default group (a collective when torch.distributed is initialized: call on every rank).
    Other ranks report 0 for the file-system parts (rank 0 alone writes the manifest and the ledger row)."""
    trip = round_trip_s()
    if dist.is_initialized() and dist.get_rank() != 0:
        return FixedCost(manifest_s=0.0, ledger_s=0.0, round_trip_s=trip)
    with tempfile.TemporaryDirectory(prefix=".fixed-cost-", dir=directory) as where:
        manifest = _manifest_s(Path(where), manifest_bytes)
        ledger = _ledger_s(Path(where))
    return FixedCost(manifest_s=manifest, ledger_s=ledger, round_trip_s=trip)


def hash_in_parallel(views: Sequence[memoryview], threads: int) -> float:
    """Seconds to SHA-256 ``views`` on ``threads`` threads at once (each thread a share of about equal bytes)."""
    shares: list[list[memoryview]] = [[] for _ in range(max(1, threads))]
    sizes = [0] * len(shares)
    for view in sorted(views, key=lambda v: -v.nbytes):
        at = sizes.index(min(sizes))
        shares[at].append(view)
        sizes[at] += view.nbytes

    def run(share: list[memoryview]) -> None:
        h = hashlib.sha256()
        for view in share:
            h.update(view)  # hashlib releases the GIL for large buffers

    workers = [threading.Thread(target=run, args=(share,)) for share in shares]
    started = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return time.perf_counter() - started


def median_ratio(numerators: Sequence[float], denominators: Sequence[float]) -> float:
    """The median of the per-rep ratios."""
    return statistics.median(a / b for a, b in zip(numerators, denominators, strict=True))


def interval(numerators: Sequence[float], denominators: Sequence[float]) -> tuple[float, float]:
    """A 95% interval of :func:`median_ratio`, by resampling the reps (fixed seed: the same runs, the same interval)."""
    ratios = np.array([a / b for a, b in zip(numerators, denominators, strict=True)])
    if len(ratios) < 2:
        return float(ratios[0]), float(ratios[0])
    boot = np.median(np.random.default_rng(0).choice(ratios, size=(2000, len(ratios))), axis=1)
    return float(np.quantile(boot, 0.025)), float(np.quantile(boot, 0.975))


@dataclass(frozen=True)
class LoadFixedCost:
    """One measurement of a verified load's per-load fixed work (see the module note), in seconds."""

    manifest_s: float
    """Read ``manifest.json`` and SHA-256 it (rank 0; 0 on the other ranks)."""
    round_trip_s: float
    """One barrier of the process group (0 at W=1)."""

    def total_s(self) -> float:
        """The fixed term of a verified load."""
        return self.manifest_s + self.round_trip_s


def load_fixed_cost(manifest: Path) -> LoadFixedCost:
    """Time a verified load's fixed work once: rank 0 reads and hashes ``manifest`` (the checkpoint's own
    ``manifest.json``, on the storage being measured), and one barrier of the default group (a collective when
    torch.distributed is initialized: call on every rank)."""
    trip = round_trip_s()
    if dist.is_initialized() and dist.get_rank() != 0:
        return LoadFixedCost(manifest_s=0.0, round_trip_s=trip)
    started = time.perf_counter()
    hashlib.sha256(manifest.read_bytes()).hexdigest()
    return LoadFixedCost(manifest_s=time.perf_counter() - started, round_trip_s=trip)


def verification_floor_s(*, floor: float, fixed: float) -> float:
    """A verified load's verification floor: its floor plus the fixed term (seconds; see the module note)."""
    return floor + fixed
