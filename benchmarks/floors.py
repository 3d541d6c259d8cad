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
"""

from __future__ import annotations

import hashlib
import statistics
import threading
import time
from collections.abc import Sequence

import numpy as np

__all__ = ["floor_s", "hash_in_parallel", "interval", "median_ratio"]


def floor_s(
    *, plain_s: float, plain_cpu_s: float, hash_one_thread_s: float, hash_parallel_s: float, cores: int
) -> float:
    """The floor of one rep (see the module note)."""
    return max(plain_s, (plain_cpu_s + hash_one_thread_s) / max(1, cores), hash_parallel_s)


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
