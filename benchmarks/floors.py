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

Note: a floor of plain's work, which shardline's writer no longer does all of. Plain's CPU time
includes ``torch.save``'s CRC-32 of every record (about 70 ms of a 192 MiB save on machine B);
shardline's writer skips it on torch 2.13 and later, where it can do so for its own threads alone
(``shardline._torch_compat.skip_save_crc32_here``: no reader checks the CRC, and the file's
SHA-256 covers the same bytes). So there a lineage save can end under this floor: the floor stays
what a writer doing plain DCP's work plus the hash cannot beat, the issue's definition, and is not
lowered by the work shardline chose to drop.

Note: the durable floor (:func:`durable_floor_s`). The floor above counts none of what a lineage
save does once per save whatever its size, which plain DCP does not do at all, so at a small
checkpoint it says nothing about those. What a lineage save cannot skip (:func:`fixed_cost`),
timed in the same run on the same storage:

* its commit records made durable: the manifest, the provenance statement, ``manifest.sha256``
  and ``SHA256SUMS`` (four small files, at the sizes the save wrote: :data:`RECORD_SIZES` by
  default) written into the checkpoint's temporary directory, fsynced together with that
  directory from threads kept for it (one journal commit where the file system groups them),
  the directory renamed to its final name, and the parent fsynced (the commit point needs it);
* at W>1, two round trips of the process group (barriers): the ranks learn the directory rank 0
  reserved before they write into it, and the outcome after the commit;
* with ``ledger=True`` (a save that records its row: ``CheckpointManager.save``), one SQLite
  commit with the ledger's settings (``journal_mode=DELETE``, ``synchronous=FULL``).
  ``shardline.checkpoint.save`` records no row, so its durable floor leaves the ledger out.

The durable floor is the floor plus that fixed term: still a lower bound. Not in it: building and
hashing the records (CPU, well under a millisecond at a few ranks), the agreement after the
capture (a third round trip at W>1: every rank's state dict was built before any rank writes),
and the last file's hash where it trails the writes (the floor's hash terms assume perfect overlap).

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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch.distributed as dist

__all__ = [
    "RECORD_SIZES",
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


RECORD_SIZES: tuple[int, ...] = (1915, 881, 80, 403)
"""Bytes of a save's commit records: ``manifest.json``, ``provenance.intoto.json``, ``manifest.sha256``,
``SHA256SUMS`` (a 12 MiB, one-rank, two-file save of ``benchmarks.checkpoint_save``)."""


@dataclass(frozen=True)
class FixedCost:
    """One measurement of a lineage save's per-save fixed work (see the module note), in seconds."""

    records_s: float
    """Write the commit records, fsync them and their directory together, rename it into place, fsync the parent."""
    ledger_s: float
    """One SQLite commit (one row) with the ledger's settings."""
    round_trips_s: float
    """Two barriers of the process group (0 at W=1)."""

    def total_s(self, *, ledger: bool) -> float:
        """The fixed term: the records, the round trips, and the ledger commit where the save records a row."""
        return self.records_s + self.round_trips_s + (self.ledger_s if ledger else 0.0)


def floor_s(
    *, plain_s: float, plain_cpu_s: float, hash_one_thread_s: float, hash_parallel_s: float, cores: int
) -> float:
    """The floor of one rep (see the module note)."""
    return max(plain_s, (plain_cpu_s + hash_one_thread_s) / max(1, cores), hash_parallel_s)


def durable_floor_s(*, floor: float, fixed: FixedCost, ledger: bool) -> float:
    """The durable floor of one rep: :func:`floor_s`'s floor plus the fixed term (see the module note)."""
    return floor + fixed.total_s(ledger=ledger)


def round_trip_s(*, count: int = 1) -> float:
    """Seconds of ``count`` barriers of the default process group, one after another (every rank calls it; 0
    without one, or at W=1)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return 0.0
    dist.barrier()  # the ranks arrive together: the timed ones are round trips, not a wait for a late rank
    started = time.perf_counter()
    for _ in range(count):
        dist.barrier()
    return time.perf_counter() - started


_FSYNC_THREADS: ThreadPoolExecutor | None = None


def _fsync_threads() -> ThreadPoolExecutor:
    """Threads kept for the records' fsyncs (a save keeps its own: starting threads is not part of the floor)."""
    global _FSYNC_THREADS
    if _FSYNC_THREADS is None:
        _FSYNC_THREADS = ThreadPoolExecutor(max_workers=8, thread_name_prefix="floor-fsync")
    return _FSYNC_THREADS


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _records_s(directory: Path, sizes: Sequence[int]) -> float:
    blobs = [os.urandom(size) for size in sizes]
    tmp, final = directory / ".step.tmp", directory / "step"
    tmp.mkdir()  # not timed: a save makes its directory before it writes, as plain DCP does
    threads = _fsync_threads()
    list(threads.map(lambda _: None, range(len(sizes) + 1)))  # started before the timed part
    started = time.perf_counter()
    fds = []
    try:
        for n, blob in enumerate(blobs):
            fds.append(os.open(tmp / f"record-{n}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))
            os.write(fds[-1], blob)
        fds.append(os.open(tmp, os.O_RDONLY))
        list(threads.map(os.fsync, fds))  # at once: where the file system groups them, one journal commit
    finally:
        for fd in fds:
            os.close(fd)
    os.rename(tmp, final)
    _fsync_dir(directory)
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


def fixed_cost(directory: Path, *, record_sizes: Sequence[int] = RECORD_SIZES) -> FixedCost:
    """Time a lineage save's fixed work once, in a fresh directory under ``directory`` (removed after), on rank 0;
    and two barriers of the default group (a collective when torch.distributed is initialized: call on every rank).
    ``record_sizes``: the bytes of each commit record (pass those of the save being measured). Other ranks report
    0 for the file-system parts (rank 0 alone writes the records and the ledger row)."""
    trips = round_trip_s(count=2)
    if dist.is_initialized() and dist.get_rank() != 0:
        return FixedCost(records_s=0.0, ledger_s=0.0, round_trips_s=trips)
    with tempfile.TemporaryDirectory(prefix=".fixed-cost-", dir=directory) as where:
        records = _records_s(Path(where), record_sizes)
        ledger = _ledger_s(Path(where))
    return FixedCost(records_s=records, ledger_s=ledger, round_trips_s=trips)


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
