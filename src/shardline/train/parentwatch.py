"""Workers never outlive their launcher: a parent-death signal, and a watchdog thread as a fallback.

A worker whose launcher dies (``kill -9``, an out-of-memory kill, a lost SSH session) must not
train on: it would keep the run directory's temporary files in use and race the next attempt
for the same checkpoints. On Linux the kernel kills the worker when its parent dies
(``prctl(PR_SET_PDEATHSIG, SIGKILL)``); everywhere, a daemon thread polls the parent pid and
exits the process when the worker has been re-parented. Both are armed by
:func:`bind_to_parent` at the very start of a worker -- under shardline's own launcher and under
torchrun's agent alike, since either is the worker's parent process.

Note: ``PR_SET_PDEATHSIG`` fires when the *thread* that forked the child ends, not the process;
torch's launchers start their workers from their main thread, which lives as long as they do.
A parent that died before the signal was armed is caught by comparing ``os.getppid()`` with the
pid the launcher passed (or the one seen at start) right after arming it.

Note: the one exception is a preemption save in flight (:func:`outlive_parent`, called at the
first SIGTERM). torchrun's agent exits at its third SIGTERM, and a launcher may be killed while
its workers save; the workers then finish the step, commit ``step-N-preempted`` and exit, all
within ``trainer.preemption_grace_s``, whose deadline (:mod:`.preemption`) ends them if they
have not by then. They train no further step.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import threading
import time

__all__ = ["bind_to_parent", "outlive_parent"]

log = logging.getLogger("shardline.train")

_PR_SET_PDEATHSIG = 1
_ORPHAN_EXIT_CODE = 128 + signal.SIGKILL
_outliving = threading.Event()


def _set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Arm ``PR_SET_PDEATHSIG`` with ``sig`` (0 disarms it; Linux); False where it is not available."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def _orphaned(parent: int) -> None:
    with contextlib.suppress(Exception):
        print(f"shardline: the launcher (pid {parent}) is gone; this worker (pid {os.getpid()}) exits", file=sys.stderr)
    os._exit(_ORPHAN_EXIT_CODE)


def _watch(parent: int, poll_s: float) -> None:
    while True:
        time.sleep(poll_s)
        if os.getppid() != parent and not _outliving.is_set():
            _orphaned(parent)


def outlive_parent() -> None:
    """From now on, let this process outlive its launcher: a preemption save is in flight (see the note).

    Call it from the main thread (the parent-death signal belongs to the thread that armed it).
    """
    _outliving.set()
    _set_parent_death_signal(0)


def bind_to_parent(*, parent_pid: int | None = None, poll_s: float = 1.0) -> int:
    """Make this process exit when its parent (the launcher) dies; returns the parent's pid.

    Args:
        parent_pid: The launcher's pid when it is known (it passes its own); default: the
            current parent.
        poll_s: How often the watchdog thread checks the parent pid.
    """
    parent = os.getppid() if parent_pid is None else parent_pid
    armed = _set_parent_death_signal()
    if os.getppid() != parent:  # died before the signal was armed
        _orphaned(parent)
    threading.Thread(target=_watch, args=(parent, poll_s), name="shardline-parent-watch", daemon=True).start()
    log.debug("bound to launcher pid %d (parent-death signal %s)", parent, "armed" if armed else "unavailable")
    return parent
