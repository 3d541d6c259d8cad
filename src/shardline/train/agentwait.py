"""How long torchrun's agent lets a worker save after SIGTERM before it sends SIGKILL.

When torchrun's agent gets SIGTERM (a scheduler stopping the job) it passes the signal on to its
workers, waits its shutdown timeout, then kills those still running: a preemption save that needs
longer than that is lost, whatever ``trainer.preemption_grace_s`` says. The timeout is the
agent's ``--shutdown-timeout`` flag, else ``PET_SHUTDOWN_TIMEOUT`` (torchrun reads each flag from
``PET_<NAME>``), else ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, else 30 s; a torch without the setting
(torch 2.6) always waits 30 s. A worker cannot change it; it can only read it, to warn.

Note: honest detection only. The flag is read from the agent's command line (``/proc/PPID/cmdline``,
Linux), so the parent must be recognisably torchrun (``torch.distributed.run`` or ``torchrun``);
under any other launcher, or where the command line cannot be read, nothing is claimed. A restart
that torchrun decides itself (a node joined or failed) stops the workers with torch 2.13's fixed
30 s, whatever the setting: see docs/training.md.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["AgentWait", "grace_warning", "torchrun_wait"]

_DEFAULT_S = 30.0
_FLAGS = ("--shutdown-timeout", "--shutdown_timeout")
_ENVS = ("PET_SHUTDOWN_TIMEOUT", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT")


@dataclass(frozen=True)
class AgentWait:
    """Seconds torchrun's agent waits after its SIGTERM before SIGKILL, and where the number comes from."""

    seconds: float
    source: str
    settable: bool
    """Whether this torch has the setting (``--shutdown-timeout``)."""


def _torchrun_options(pid: int) -> list[str] | None:
    """The arguments after ``torchrun`` on the command line of ``pid``; None if it is not torchrun or unreadable."""
    try:
        argv = [a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
    except OSError:
        return None
    for i, arg in enumerate(argv[:4]):
        if arg == "torch.distributed.run" or (i < 2 and Path(arg).name == "torchrun"):
            return argv[i + 1 :]
    return None


def _flag(options: list[str]) -> str | None:
    """The value of ``--shutdown-timeout`` among torchrun's own options (before the training script)."""
    for i, arg in enumerate(options):
        if arg in ("-m", "--module", "--no-python", "--") or arg.endswith(".py"):
            return None  # the training script and its arguments follow
        for flag in _FLAGS:
            if arg == flag and i + 1 < len(options):
                return options[i + 1]
            if arg.startswith(flag + "="):
                return arg.split("=", 1)[1]
    return None


def _settable() -> bool:
    from torch.distributed.launcher.api import LaunchConfig

    return "shutdown_timeout" in LaunchConfig.__dataclass_fields__


def torchrun_wait(*, parent_pid: int | None = None) -> AgentWait | None:
    """How long this worker's torchrun agent waits after SIGTERM before SIGKILL; None when unknown.

    Args:
        parent_pid: The agent's pid (default: this process's parent).
    """
    options = _torchrun_options(os.getppid() if parent_pid is None else parent_pid)
    if options is None:
        return None
    if not _settable():
        return AgentWait(_DEFAULT_S, "this torch's fixed wait", settable=False)
    found = _flag(options)
    if found is not None:
        source = "torchrun --shutdown-timeout"
    else:
        name = next((n for n in _ENVS if os.environ.get(n)), None)
        found, source = (os.environ[name], name) if name else (str(_DEFAULT_S), "torchrun's default")
    try:
        return AgentWait(float(found), source, settable=True)
    except ValueError:
        return None  # torchrun itself refuses a value it cannot parse


def grace_warning(grace_s: float, *, parent_pid: int | None = None) -> str | None:
    """A one-line warning when ``trainer.preemption_grace_s`` exceeds torchrun's wait (None otherwise)."""
    wait = torchrun_wait(parent_pid=parent_pid)
    if wait is None or grace_s <= wait.seconds:
        return None
    enough = f"{math.ceil(grace_s) + 10}"
    fix = (
        f"start torchrun with --shutdown-timeout={enough} (or TORCH_ELASTIC_SHUTDOWN_TIMEOUT={enough}), or lower "
        f"trainer.preemption_grace_s"
        if wait.settable
        else f"this torch cannot change it: lower trainer.preemption_grace_s to at most {wait.seconds:g}"
    )
    return (
        f"trainer.preemption_grace_s={grace_s:g} is longer than torchrun's agent waits after SIGTERM before it "
        f"kills the workers ({wait.seconds:g} s, {wait.source}): a preemption save still running then is lost; "
        f"{fix}"
    )
