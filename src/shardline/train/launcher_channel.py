"""Workers tell the local launcher who they are, that they are alive, and why they failed.

Note: why not only torch's elastic error files. Those are JSON files written by the failing
worker into the run directory: on a full disk they come out empty (and torch's launcher then
fails parsing them), and a worker that is stopped or hung writes nothing at all. So each worker
also keeps a socket to the launcher on the loopback interface and sends one JSON line per event:

* ``hello`` (rank, pid) at start, ``beat`` every second from a background thread, ``bye`` at a
  clean end;
* ``error`` when the worker raises: the exception's type, first line, traceback, and whether it
  is a collective timeout;
* ``preempted`` when it stopped on a preemption signal (:mod:`.preemption`): the line to show.
  The launcher reads it even where torch's agent loses the workers' return values (its own
  SIGTERM path), and finds the workers' pids here to pass a SIGTERM on (:mod:`.relay`).

A worker whose collective timed out waits a short grace period (:func:`stall_grace_s`) before
exiting, so that every rank waiting in that collective can report too. The launcher then knows
the stalled ranks -- those that neither timed out nor failed -- and whether each still sends
heartbeats (alive, but never joined the collective) or stopped (``SIGSTOP``, or hung holding the
interpreter). It ends them at once with ``SIGKILL``, which also ends a stopped process, instead
of waiting for torch's launcher to give up on them (30 s after its ``SIGTERM``): a stalled job
ends within ``trainer.collective_timeout_s`` plus a few seconds.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from shardline.errors import error_chain

__all__ = ["ChannelServer", "LauncherChannel", "RankStatus", "is_collective_timeout", "stall_grace_s"]

_BEAT_S = 1.0
_TIMEOUT = re.compile(r"(?i)timed out|timeout")
# Errors a rank raises only because a peer died; never reported as the cause if a real one exists.
_FALLOUT = ("Connection closed by peer", "Connection reset by peer", "remote worker crashing", "SignalException")


def stall_grace_s(timeout_s: float) -> float:
    """How long a rank whose collective timed out waits for its peers to report too (1-5 s)."""
    return min(5.0, max(1.0, 0.1 * float(timeout_s)))


def is_collective_timeout(error: BaseException) -> bool:
    """Whether ``error`` (or what caused it) is a collective that timed out (gloo, NCCL, or torch's store)."""
    from shardline.errors import ConfigurationError

    return any(
        not isinstance(e, ConfigurationError)
        and isinstance(e, (RuntimeError, TimeoutError))
        and _TIMEOUT.search(str(e))
        for e in error_chain(error)
    )


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else ""


@dataclass
class RankStatus:
    """What the launcher knows about one rank."""

    rank: int
    pid: int | None = None
    last_beat: float = 0.0
    done: bool = False
    preempted: str | None = None
    error: dict[str, Any] | None = None
    error_at: float = 0.0


@dataclass
class _Stall:
    stalled: list[int]
    waited: list[int]
    silent_s: dict[int, float] = field(default_factory=dict)


class LauncherChannel:
    """The worker's side: connect to ``address`` (``host:port``), say hello, beat, report a failure."""

    def __init__(self, address: str, rank: int) -> None:
        self.rank = rank
        host, port = address.rsplit(":", 1)
        self._lock = threading.Lock()
        self._sock: socket.socket | None = socket.create_connection((host, int(port)), timeout=10)
        self._stop = threading.Event()
        self._send({"kind": "hello", "rank": rank, "pid": os.getpid()})
        self._thread = threading.Thread(target=self._beat, name="shardline-heartbeat", daemon=True)
        self._thread.start()

    def _send(self, message: dict[str, Any]) -> None:
        with self._lock:
            if self._sock is None:
                return
            try:
                self._sock.sendall(json.dumps(message).encode() + b"\n")
            except OSError:  # the launcher is gone: nothing left to tell
                self._sock = None

    def _beat(self) -> None:
        while not self._stop.wait(_BEAT_S):
            self._send({"kind": "beat", "rank": self.rank})

    def failed(self, error: BaseException) -> None:
        """Report ``error`` (type, first line, traceback, whether a collective timed out)."""
        self._send(
            {
                "kind": "error",
                "rank": self.rank,
                "type": type(error).__name__,
                "message": _first_line(error),
                "traceback": "".join(traceback.format_exception(error)),
                "timeout": is_collective_timeout(error),
            }
        )

    def preempted(self, message: str) -> None:
        """Report a stop on a preemption signal (``message``: the line the launcher shows)."""
        self._send({"kind": "preempted", "rank": self.rank, "message": message})

    def close(self, *, clean: bool) -> None:
        """Stop beating (saying ``bye`` first if the worker ended cleanly) and close the socket."""
        self._stop.set()
        if clean:
            self._send({"kind": "bye", "rank": self.rank})
        with self._lock:
            if self._sock is not None:
                with contextlib.suppress(OSError):
                    self._sock.close()
                self._sock = None


class ChannelServer:
    """The launcher's side: hear from ``world_size`` workers and end stalled ones.

    Args:
        world_size: Ranks expected.
        timeout_s: ``trainer.collective_timeout_s`` (named in the verdict).
    """

    def __init__(self, world_size: int, *, timeout_s: float) -> None:
        self.world_size = world_size
        self.timeout_s = float(timeout_s)
        self.grace_s = stall_grace_s(timeout_s)
        self.ranks = {r: RankStatus(r) for r in range(world_size)}
        self.killed: list[int] = []
        self._stall: _Stall | None = None
        self._order: list[int] = []
        self._lock = threading.Lock()
        self._reaper: threading.Timer | None = None
        self._closed = False
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(world_size + 4)
        self.address = f"127.0.0.1:{self._sock.getsockname()[1]}"
        threading.Thread(target=self._accept, name="shardline-launcher-channel", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as lines:
            for line in lines:
                try:
                    message = json.loads(line)
                    self._handle(message)
                except (ValueError, KeyError, TypeError):
                    continue

    def _handle(self, message: dict[str, Any]) -> None:
        rank = int(message["rank"])
        now = time.monotonic()
        with self._lock:
            status = self.ranks.setdefault(rank, RankStatus(rank))
            status.last_beat = now
            kind = message["kind"]
            if kind == "hello":
                status.pid = int(message["pid"])
            elif kind == "bye":
                status.done = True
            elif kind == "preempted":
                status.preempted = str(message["message"])
            elif kind == "error" and status.error is None:
                status.error, status.error_at = message, now
                self._order.append(rank)
                if self._reaper is None and not self._closed:
                    # Note: wait a little longer than a timed-out rank lingers, so its peers' errors arrive.
                    self._reaper = threading.Timer(self.grace_s + 0.5, self._reap)
                    self._reaper.daemon = True
                    self._reaper.start()

    def _reap(self) -> None:
        """After the first failure: name stalled ranks (if a collective timed out) and end stuck workers."""
        now = time.monotonic()
        with self._lock:
            timed_out = [r for r in self._order if (self.ranks[r].error or {}).get("timeout")]
            silent = {
                r: now - rep.last_beat
                for r, rep in self.ranks.items()
                if rep.error is None and not rep.done and now - rep.last_beat > 2.5 * _BEAT_S
            }
            if timed_out:
                stalled = sorted(r for r, rep in self.ranks.items() if rep.error is None and not rep.done)
                self._stall = _Stall(stalled=stalled, waited=sorted(timed_out), silent_s=silent)
                victims = stalled
            else:
                victims = sorted(silent)  # stopped or hung: torch's SIGTERM would not end them
        for rank in victims:
            self._kill(rank)

    def _kill(self, rank: int) -> None:
        pid = self.ranks[rank].pid
        if pid is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
            self.killed.append(rank)

    def close(self) -> None:
        """Stop listening and stop the pending reaper (torch's launcher has ended every worker by now)."""
        with self._lock:
            self._closed = True
            if self._reaper is not None:
                self._reaper.cancel()
        with contextlib.suppress(OSError):
            self._sock.close()

    def pids(self) -> list[int]:
        """The pids of the workers that said hello and have not ended cleanly."""
        with self._lock:
            return [rep.pid for rep in self.ranks.values() if rep.pid is not None and not rep.done]

    def preempted(self) -> str | None:
        """The line of a worker that stopped on a preemption signal (the lowest rank's), or None."""
        with self._lock:
            lines = [rep.preempted for _, rep in sorted(self.ranks.items()) if rep.preempted]
        return lines[0] if lines else None

    def verdict(self) -> tuple[str, str] | None:
        """``(headline, traceback)`` naming what went wrong, or None if no worker reported a failure."""
        with self._lock:
            stall, order = self._stall, list(self._order)
            errors = {r: self.ranks[r].error for r in order}
        setting = f"trainer.collective_timeout_s={self.timeout_s:g}"
        if stall is not None and stall.stalled:
            parts = []
            for r in stall.stalled:
                quiet = stall.silent_s.get(r)
                why = (
                    f"no heartbeat for {quiet:.0f} s: stopped, or hung holding the interpreter"
                    if quiet is not None
                    else "alive, but it never joined the collective"
                )
                parts.append(f"rank {r} ({why})")
            waited = ", ".join(str(r) for r in stall.waited)
            first = errors[stall.waited[0]] or {}
            return (
                f"a collective timed out after {setting} s: stalled {'; '.join(parts)}, while rank(s) {waited} "
                f"waited; the job was stopped. If the stalled rank is only slow, raise trainer.collective_timeout_s.",
                str(first.get("traceback", "")),
            )
        if not order:
            return None
        real = [r for r in order if not any(m in str(errors[r]) for m in _FALLOUT)]
        if not real:
            with self._lock:
                vanished = sorted(r for r, rep in self.ranks.items() if rep.pid is not None and rep.error is None)
            if vanished:  # the cause died without a word; the errors are only its peers noticing
                fallout = errors[order[0]] or {}
                return (
                    f"worker rank {', '.join(map(str, vanished))} ended without reporting an error (killed, crashed or "
                    f"exited abruptly); the other ranks then lost their connection to it ({fallout.get('type')})",
                    "",
                )
        rank = (real or order)[0]
        error = errors[rank] or {}
        headline = f"worker rank {rank} failed: {error.get('type')}: {error.get('message')}"
        if error.get("timeout"):
            headline += f" (a collective timed out after {setting} s)"
        return headline, str(error.get("traceback", ""))
