"""Preemption saves: SIGTERM finishes the step in flight, saves it, and exits within a grace period.

SIGTERM is what torchrun sends its workers before a restart, what SLURM sends before it
preempts or cancels a job (``scontrol requeue``, ``--signal``), and what cloud schedulers send
with a preemption notice. A worker that gets it sets a flag and carries on; at the end of every
step the ranks agree on the flags (one all-reduce of one integer), so every rank -- including
those the signal did not reach -- stops after the *same* step, writes a checkpoint tagged
``preempted`` (``step-N-preempted``) and exits. ``trainer.resume=auto`` resumes from it like from
any committed checkpoint, so a restart loses at most the step that was in flight.

Note: the deadline. From the first signal the worker has ``trainer.preemption_grace_s``
seconds; then it exits at once (status 143, as if killed by the signal) from a watchdog thread,
whatever the main thread is doing. A save cut short this way never committed: its temporary
directory is removed by the next resume and the previous committed checkpoint stays the newest.
Later SIGTERMs are logged and ignored: a scheduler that signals every process of the job at once
(SLURM, ``kill -TERM -- -PGID``) reaches each worker directly *and* through its launcher, which
passes the signal on, and neither copy may cut the save short. Only the deadline, or another
signal (SIGINT raises ``KeyboardInterrupt``; SIGKILL), ends it early. Once a signal arrived, the
handler stays installed until the process exits (a late copy cannot kill a worker that has
already saved), and the worker no longer dies with its launcher (:mod:`.parentwatch`; torchrun's
agent exits at its third SIGTERM): the deadline bounds its life instead. A launcher that kills
its workers sooner (torchrun's agent sends SIGKILL after its ``--shutdown-timeout``) bounds the
grace period too.

Note: the agreement is a collective on a gloo group (the training group when it is one, else a
gloo group made for it), so it reads one host integer per step and never synchronizes a CUDA
stream.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from types import FrameType

import torch
import torch.distributed as dist

from shardline.train.parentwatch import outlive_parent

__all__ = ["PREEMPTED", "PREEMPTED_EXIT_CODE", "Preempted", "PreemptionGuard"]

log = logging.getLogger("shardline.train")

PREEMPTED = "preempted"
"""The tag of a preemption save (``step-N-preempted``)."""
PREEMPTED_EXIT_CODE = 128 + signal.SIGTERM
"""Exit status after a preemption: what a process killed by SIGTERM reports to its shell."""


class Preempted(BaseException):
    """Every rank stopped after ``step`` on a preemption signal; ``checkpoint`` is the save of that step (or None).

    A ``BaseException``, so that handlers of errors (``except Exception``) let it through.
    """

    def __init__(self, step: int, checkpoint: str | None) -> None:
        where = f"saved {checkpoint}" if checkpoint else "no checkpoint was written"
        super().__init__(f"preempted (SIGTERM) after step {step}; {where}; continue with trainer.resume=auto")
        self.step = step
        self.checkpoint = checkpoint


class PreemptionGuard:
    """Catches SIGTERM in this process and lets the ranks agree on stopping (see the module note).

    Args:
        grace_s: Seconds from the first signal to the forced exit.
        world_size: Ranks of the job (1: no agreement collective).
        backend: The training group's backend (a gloo group is made for the flag if it is not gloo).
        timeout_s: Timeout of that group's collectives.
    """

    def __init__(self, *, grace_s: float, world_size: int, backend: str, timeout_s: float) -> None:
        self.grace_s = float(grace_s)
        self.world_size = world_size
        self.requested_at: float | None = None
        self._previous: Callable[[int, FrameType | None], object] | int | None = None
        self._installed = False
        self._group: dist.ProcessGroup | None = None
        if world_size > 1:
            self._group = (
                None if backend == "gloo" else dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
            )
        self._flag = torch.zeros(1, dtype=torch.int32)

    def install(self) -> PreemptionGuard:
        """Handle SIGTERM in this process (main thread only; elsewhere this does nothing)."""
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)
            self._installed = True
        return self

    def uninstall(self) -> None:
        """Put the previous SIGTERM handler back, unless a signal arrived (see the module note).

        After a signal this process is on its way out (the deadline watchdog keeps running), and
        a late SIGTERM must not kill it between the committed save and its exit.
        """
        if self._installed and self.requested_at is None:
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
            self._installed = False

    @property
    def requested(self) -> bool:
        """Whether this process got a preemption signal."""
        return self.requested_at is not None

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.requested_at is not None:
            left = self.grace_s - (time.monotonic() - self.requested_at)
            log.warning(
                "SIGTERM again: ignored; the preemption save goes on (%.0f s left of trainer.preemption_grace_s)",
                max(0.0, left),
            )
            return
        self.requested_at = time.monotonic()
        outlive_parent()  # a launcher killed now must not take the save with it; the deadline bounds it
        log.warning(
            "SIGTERM: finishing the step in flight, then saving a preemption checkpoint (grace %.0f s)", self.grace_s
        )
        threading.Thread(target=self._deadline, name="shardline-preemption-deadline", daemon=True).start()

    def _deadline(self) -> None:
        time.sleep(max(0.0, self.grace_s))
        _exit_now(f"trainer.preemption_grace_s={self.grace_s:g} ran out")

    def agreed(self) -> bool:
        """Whether any rank got a preemption signal (a collective: every rank calls it once per step)."""
        self._flag.fill_(1 if self.requested else 0)
        if self.world_size > 1:
            dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group)
        return bool(self._flag.item())


def _exit_now(why: str) -> None:
    """Leave at once (no cleanup): the save in flight, if any, never commits."""
    try:
        log.error("preemption: %s; exiting now, without a preemption checkpoint", why)
        print(f"shardline: preemption: {why}; exiting now", file=sys.stderr, flush=True)
    finally:
        os._exit(PREEMPTED_EXIT_CODE)
