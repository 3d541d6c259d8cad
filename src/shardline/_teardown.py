"""Before the interpreter tears down: let torch.distributed's gloo worker threads drop what they still hold.

Note: why (pytorch/pytorch#190489). A gloo process group runs each collective on one of its worker threads
(named ``pt_gloo_runloop``). The caller goes on as soon as the collective is done; the worker then drops its
references to the collective's tensors, and dropping a tensor Python has seen takes the GIL (torch releases the
tensor's Python object, ``TensorImpl::decref_pyobject``). When a script ends right after its last collective,
the worker may ask for the GIL only after the interpreter has begun to finalize; CPython then ends that thread
with ``pthread_exit``, whose unwinding through torch's C++ destructors calls ``std::terminate``: "terminate called
without an active exception", SIGABRT, after all the script's work is done. ``destroy_process_group()`` does
not prevent it: a group lives on while anything references it --
DTensor's sharding cache keeps each mesh it has seen, and a mesh its groups -- and only the group's destruction
joins its workers.

So :func:`install` (called when shardline is imported) registers one ``atexit`` hook, which runs while the
interpreter is still whole: it releases the GIL in 1 ms sleeps until no gloo worker thread of the process is
runnable in two samples in a row (at most 2 s). A worker waiting for the GIL becomes runnable as soon as the GIL
is free, so the hook returns once every worker has dropped what it held and gone back to waiting for work. A
process without a gloo group has no such thread: the hook returns at once. Thread names and states come from
``/proc`` (Linux); elsewhere the hook does nothing.
"""

from __future__ import annotations

import atexit
import threading
import time
from pathlib import Path

__all__ = ["install", "settle_gloo_workers"]

_TASKS = Path("/proc/self/task")
_GLOO_WORKER = "pt_gloo_runloop"
_STEP_S = 0.001
_QUIET_SAMPLES = 2
_LIMIT_S = 2.0
_LOCK = threading.Lock()
_installed = False


def _gloo_workers() -> list[Path]:
    """The ``/proc`` entries of this process's gloo worker threads (none off Linux)."""
    try:
        tasks = list(_TASKS.iterdir())
    except OSError:
        return []
    found = []
    for task in tasks:
        try:
            if (task / "comm").read_text().strip() == _GLOO_WORKER:
                found.append(task)
        except OSError:  # the thread ended meanwhile
            continue
    return found


def _runnable(task: Path) -> bool:
    try:
        stat = (task / "stat").read_text()
    except OSError:  # ended
        return False
    return stat[stat.rindex(")") + 2] == "R"  # the state follows the parenthesized name


def settle_gloo_workers(*, limit_s: float = _LIMIT_S) -> bool:
    """Release the GIL until no gloo worker thread is runnable, twice in a row 1 ms apart (see the module note).

    Returns whether they settled within ``limit_s`` seconds (True at once where there is none).
    """
    workers = _gloo_workers()
    if not workers:
        return True
    deadline = time.monotonic() + limit_s
    quiet = 0
    while quiet < _QUIET_SAMPLES:
        if time.monotonic() > deadline:
            return False
        time.sleep(_STEP_S)  # the GIL is free meanwhile: a worker waiting for it takes it
        quiet = 0 if any(_runnable(task) for task in workers) else quiet + 1
    return True


def _at_exit() -> None:
    settle_gloo_workers()


def install() -> None:
    """Register the exit hook once per process (see the module note)."""
    global _installed
    with _LOCK:
        if not _installed:
            atexit.register(_at_exit)
            _installed = True
