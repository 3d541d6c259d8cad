"""Fault injection for tests: observers that kill a rank at a phase of a save, or fail its writes.

Pass one to a save (``save(..., observer=KillAtPhase("after_shards", ranks={1}))``) or to a
``CheckpointManager``. Nothing here is read from the environment: a fault exists only where
a test passed one in.

* :class:`KillAtPhase` -- the named rank(s) print one line to stderr and end at once with
  ``os._exit(FAULT_EXIT_CODE)``: no cleanup, no ``finally`` blocks, like a node that loses power.
* :class:`FailWrites` -- the named rank(s) get ``OSError(errno)`` (default ``ENOSPC``, "No
  space left on device") once they have written ``after_bytes`` bytes to checkpoint files, the
  way a full disk fails a write.
"""

from __future__ import annotations

import errno as errno_codes
import os
import sys
from collections.abc import Iterable

from shardline.checkpoint.faults.observer import SaveObserver, SavePhase

__all__ = ["FAULT_EXIT_CODE", "FailWrites", "KillAtPhase"]

FAULT_EXIT_CODE = 87


def _ranks(ranks: Iterable[int] | None) -> frozenset[int] | None:
    return None if ranks is None else frozenset(int(r) for r in ranks)


class KillAtPhase(SaveObserver):
    """End the process with ``os._exit(FAULT_EXIT_CODE)`` when one of ``ranks`` (default: any) reaches ``phase``."""

    def __init__(self, phase: SavePhase | str, *, ranks: Iterable[int] | None = None) -> None:
        self.phase = SavePhase.parse(phase)
        self.ranks = _ranks(ranks)

    def on_phase(self, phase: SavePhase, rank: int) -> None:
        if phase == self.phase and (self.ranks is None or rank in self.ranks):
            sys.stderr.write(f"shardline: fault injected at checkpoint phase {phase.value!r} on rank {rank}\n")
            sys.stderr.flush()
            os._exit(FAULT_EXIT_CODE)


class FailWrites(SaveObserver):
    """Fail checkpoint writes of ``ranks`` (default: any) with ``OSError(error)`` after ``after_bytes`` bytes.

    Counts the bytes each process wrote to checkpoint files through this observer; the first
    write that would go past ``after_bytes`` raises, as ``write(2)`` does on a full file system.
    """

    def __init__(
        self, *, error: int = errno_codes.ENOSPC, ranks: Iterable[int] | None = None, after_bytes: int = 0
    ) -> None:
        self.error = int(error)
        self.ranks = _ranks(ranks)
        self.after_bytes = int(after_bytes)
        self.written = 0

    def before_write(self, path: str, nbytes: int, rank: int) -> None:
        if self.ranks is not None and rank not in self.ranks:
            return
        if self.written + nbytes > self.after_bytes:
            raise OSError(self.error, os.strerror(self.error), path)
        self.written += nbytes
