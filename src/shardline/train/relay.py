"""The local launcher's SIGTERM: passed on to the workers once, repeats ignored, a deadline as the bound.

A scheduler stops a job with SIGTERM, either to every process at once (SLURM, ``kill -TERM --
-PGID``) or to the main process only (``docker stop``, Kubernetes, ``kill PID``). Either way
``shardline train trainer.devices=N`` must end the way a worker's preemption does
(:mod:`.preemption`): every rank finishes the step in flight, ``step-N-preempted`` commits, and
the command exits 143.

So the launcher keeps SIGTERM from torch's elastic agent (whose own handler would stop the
workers and kill them after its shutdown timeout, losing their return values) and handles it
here: the first SIGTERM is passed on to every worker (a worker that got the scheduler's copy
too ignores the repeat), later ones are logged and ignored, and the agent goes on watching the
workers, which save and return. Workers that are still running ``trainer.preemption_grace_s``
plus a margin after the first signal are killed (``SIGKILL``): each worker's own deadline
normally ends it before that.

Note: the agent's handlers are installed when it starts the workers, for the signals its
``signals_to_handle`` names; the launcher leaves SIGTERM out of them. A torch whose launch
config has no such field (torch 2.6) installs its SIGTERM handler over this one: its agent then
passes the signal on itself and waits its fixed shutdown timeout (30 s) before SIGKILL, and the
launcher reads the workers' preemption from what they send it (:mod:`.launcher_channel`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType

__all__ = ["MARGIN_S", "SigtermRelay"]

MARGIN_S = 10.0
"""Seconds the launcher waits past ``trainer.preemption_grace_s`` before it kills the workers."""
_POLL_S = 0.1


class SigtermRelay:
    """Handle SIGTERM in the launcher: pass it on to the workers once, ignore repeats, kill at the deadline.

    Args:
        grace_s: ``trainer.preemption_grace_s``.
        pids: Returns the pids of the running workers (polled: a worker that starts after the
            signal gets it too).
        margin_s: Seconds past ``grace_s`` before the workers left are killed.
    """

    def __init__(self, *, grace_s: float, pids: Callable[[], list[int]], margin_s: float = MARGIN_S) -> None:
        self.grace_s = float(grace_s)
        self.margin_s = float(margin_s)
        self.requested_at: float | None = None
        self.killed: list[int] = []
        self._pids = pids
        self._previous: Callable[[int, FrameType | None], object] | int | None = None
        self._installed = False
        self._repeats = 0
        self._done = threading.Event()

    @property
    def requested(self) -> bool:
        """Whether the launcher got SIGTERM."""
        return self.requested_at is not None

    def install(self) -> SigtermRelay:
        """Handle SIGTERM in this process (main thread only; elsewhere this does nothing)."""
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)
            self._installed = True
        return self

    def uninstall(self) -> None:
        """Stop passing signals on; put the previous handler back unless a SIGTERM arrived.

        After a SIGTERM the launcher is on its way out (exit 143): a late copy is still ignored,
        so that it cannot kill the launcher before it has reported and released the run directory.
        """
        self._done.set()
        if self._installed and self.requested_at is None:
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
            self._installed = False

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Note: only bookkeeping here; the relay thread writes and signals (a handler that writes
        # to stderr can interrupt the main thread's own write to it).
        if self.requested_at is not None:
            self._repeats += 1
            return
        self.requested_at = time.monotonic()
        threading.Thread(
            target=self._relay, args=(self.requested_at,), name="shardline-sigterm-relay", daemon=True
        ).start()

    def _relay(self, since: float) -> None:
        """Pass SIGTERM on to each worker once; at the deadline, SIGKILL those left."""
        grace = f"trainer.preemption_grace_s={self.grace_s:g}"
        _say(f"SIGTERM: the workers finish the step in flight and save it ({grace})")
        told: set[int] = set()
        repeats = 0
        while not self._done.is_set():
            for pid in self._pids():
                if pid not in told:
                    told.add(pid)
                    _send(pid, signal.SIGTERM)
            if self._repeats > repeats:
                repeats = self._repeats
                _say(f"SIGTERM again: ignored; the workers go on saving ({grace})")
            if time.monotonic() >= since + self.grace_s + self.margin_s:
                left = [pid for pid in self._pids() if _send(pid, signal.SIGKILL)]
                self.killed.extend(left)
                if left:
                    _say(f"workers {left} still ran {self.grace_s + self.margin_s:g} s after SIGTERM ({grace}); killed")
                return
            self._done.wait(_POLL_S)


def _send(pid: int, sig: signal.Signals) -> bool:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _say(line: str) -> None:
    with contextlib.suppress(Exception):
        print(f"shardline: {line}", file=sys.stderr, flush=True)
