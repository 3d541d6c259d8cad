"""How a save hashes and flushes its local files, decided from what this machine measures at that location.

Note: why the choice is measured, not fixed. A durable save's hash is hidden when it runs on a core
the plain save leaves idle. Where that idle time is depends on the storage: on a disk whose fsync
is slow the cores idle while the flush waits, and hashing each file from its fsync on hides the
whole hash there without slowing the writes (``hash_during_writes=False``); on a fast disk, or
tmpfs where fsync is free, that wait is shorter than the hash, which then trails the save, and
hashing as the bytes are written -- on whatever core is idle at any moment -- is the better bet
(``True``). Starting writeback early (:func:`~.fsutil.start_writeback`) shortens the flush on a
slow disk and only costs system calls where the flush was short already. A constant tuned on
one disk is wrong on the next, so each storage location is probed once and the result cached:

* The probe (:func:`probe`, about 0.2-1 s) hashes 32 MiB in memory on one thread, then writes
  32 MiB into a hidden file where the checkpoint goes and fsyncs it, three ways (writeback left
  to the fsync, started every 4 MiB, every 16 MiB), three times each, keeping each way's fastest; on a
  disk so slow that this passes 3 s, it stops and decides on the writes it has.
* The decision (:func:`decide`, a pure function of the probe, the rank's writer threads and its
  cores): the writeback step whose write + fsync was fastest, if it beat the fsync alone by 5%
  and the fsync alone was not about free (under 5% of the write + fsync: tmpfs);
  then, with ``k = min(writers, cores)`` files hashed at once, the flush tail the probe waited
  for after its writes against the hash's time on ``k`` threads. A tail 1.5 times as long
  hides the hash from the fsync on; a shorter one, or a core left free during the writes
  (fewer writers than cores), hashes during the writes.
* The cache (:func:`tuning_for`): ``$XDG_CACHE_HOME/shardline/save-calibration.json`` (default
  ``~/.cache``), one entry per host and file system (``st_dev`` and ``statvfs``'s ``f_fsid``),
  measured again after :data:`MAX_AGE_S` or when the probe's format changes. Processes on one
  host take turns through a lock on the cache, so ranks probe a location once between them.
  ``SHARDLINE_SAVE_CALIBRATION=off`` keeps the fixed behaviour (hash from the fsync on when every
  core writes, writeback every 4 MiB); ``=force`` probes at every save (and refreshes the cache).

Durability does not depend on any of this: every file is fsynced before the commit either way.
A probe that fails (a full disk, a read-only cache) falls back to the fixed behaviour.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shardline.checkpoint.storage.fsutil import start_writeback
from shardline.errors import ConfigurationError

__all__ = [
    "DEFAULT_WRITEBACK_EVERY",
    "ENV",
    "MAX_AGE_S",
    "Probe",
    "SaveTuning",
    "cache_path",
    "decide",
    "fixed_tuning",
    "probe",
    "tuning_for",
]

ENV = "SHARDLINE_SAVE_CALIBRATION"
"""``off``: the fixed behaviour, no probe; ``force``: probe at every save; unset or ``auto``: probe once, cached."""
DEFAULT_WRITEBACK_EVERY = 4 << 20
"""The writeback step without a calibration (and the smaller of the two the probe tries)."""
MAX_AGE_S = 7 * 24 * 3600.0
"""A cached probe older than this is measured again (disks, their neighbours and kernels change)."""
_PROBE_BYTES = 32 << 20
_CHUNK = 4 << 20
_STEPS: tuple[int, ...] = (0, DEFAULT_WRITEBACK_EVERY, 16 << 20)  # 0: writeback left to the fsync
_FORMAT = 1  # the probe's format: entries of another are measured again
_GAIN = 0.95  # early writeback is chosen only where it cut the probe's write + fsync by 5%
_FREE_FLUSH = 0.05  # an fsync under this share of the probe's write + fsync counts as free: no early writeback
_MARGIN = 1.5  # the flush tail must be this many times the hash's time to hash from the fsync on
_LOCK_WAIT_S = 30.0
_PROBE_BUDGET_S = 3.0  # no further write is started after this long (a disk of a few MB/s)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Probe:
    """What one location measured (seconds for ``nbytes``; per writeback step: ``(write, fsync)`` seconds)."""

    nbytes: int
    hash_s: float
    """One thread's SHA-256 of ``nbytes`` in memory."""
    steps: dict[int, tuple[float, float]]
    """Writeback step in bytes (0: none) -> (seconds to write ``nbytes`` into the file, then to fsync it)."""

    def to_json(self) -> dict[str, Any]:
        """Plain JSON data (the cache's ``probe`` entry)."""
        return {"nbytes": self.nbytes, "hash_s": self.hash_s, "steps": {str(k): list(v) for k, v in self.steps.items()}}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Probe:
        """The probe :meth:`to_json` wrote."""
        steps = {int(k): (float(v[0]), float(v[1])) for k, v in data["steps"].items()}
        return cls(nbytes=int(data["nbytes"]), hash_s=float(data["hash_s"]), steps=steps)


@dataclass(frozen=True)
class SaveTuning:
    """How a rank's local files are hashed and flushed in one save (see the module note)."""

    hash_during_writes: bool
    """True: each file's bytes are hashed as they are written; False: from the file's fsync on."""
    writeback_every: int | None
    """Start the file's writeback every this many bytes written; None: leave it all to the fsync."""
    hash_threads: int
    """Files of the rank hashed at once (one helper thread each)."""
    source: str
    """``measured`` (probed now), ``cached``, ``fixed`` (calibration off) or ``fallback`` (the probe failed)."""
    reason: str
    """The decision in words, with the figures behind it."""


def fixed_tuning(*, writers: int, cores: int, source: str = "fixed", reason: str = "") -> SaveTuning:
    """The behaviour without a calibration: hash during the writes only where a core is left free for it."""
    return SaveTuning(
        hash_during_writes=writers < cores,
        writeback_every=DEFAULT_WRITEBACK_EVERY,
        hash_threads=max(1, min(writers, cores)),
        source=source,
        reason=reason or f"{ENV}=off: hash during the writes only with fewer writers ({writers}) than cores ({cores})",
    )


def decide(measured: Probe, *, writers: int, cores: int, source: str = "measured") -> SaveTuning:
    """The tuning for a rank writing ``writers`` files on ``cores`` cores, from a location's probe (pure)."""
    k = max(1, min(writers, cores))
    total = {step: write + flush for step, (write, flush) in measured.steps.items()}
    best = min(total, key=lambda step: (total[step], step))
    step = best if 0 not in total or total[best] <= _GAIN * total[0] else 0
    if 0 in measured.steps and measured.steps[0][1] < _FREE_FLUSH * total[0]:
        # Note: early writeback can only shorten the flush; where the fsync alone was about free (tmpfs, a
        # cache that acknowledges at once) there is nothing to shorten, and on tmpfs each call costs CPU
        # (about 3 ms per 4 MiB here) however the probe's noise ranked it.
        step = 0
    write, flush = measured.steps[step]
    mib = measured.nbytes / 2**20
    # Note: the probe's own flush tail is the lower bound of the save's: k writers fill the page cache faster than
    # the probe's one, which lengthens the tail only where the disk is the bottleneck. Hashing from the fsync on
    # is the bet that the tail hides the hash (else the rest of the hash trails the save); hashing during the
    # writes always uses whatever core is idle. So the bet is taken only on the lower bound, with a margin.
    tail_per_byte = flush / measured.nbytes
    hash_per_byte = measured.hash_s / (k * measured.nbytes)
    during = writers < cores or tail_per_byte < _MARGIN * hash_per_byte
    figures = (
        f"per {mib:.0f} MiB: write {write * 1e3:.1f} ms and fsync {flush * 1e3:.1f} ms (writeback "
        f"{'every ' + str(step >> 20) + ' MiB' if step else 'left to the fsync'}), one SHA-256 pass "
        f"{measured.hash_s * 1e3:.1f} ms; {writers} writer(s) on {cores} core(s): flush tail "
        f"{tail_per_byte * measured.nbytes * 1e3:.1f} ms vs the hash on {k} thread(s) "
        f"{hash_per_byte * measured.nbytes * 1e3:.1f} ms"
    )
    if writers < cores:
        why = "a core is free during the writes: hash as the bytes are written"
    elif during:
        why = "the flush is shorter than the hash: hash as the bytes are written"
    else:
        why = "the flush is long enough to hide the hash: hash from each file's fsync on"
    return SaveTuning(
        hash_during_writes=during,
        writeback_every=step or None,
        hash_threads=k,
        source=source,
        reason=f"{why} ({figures})",
    )


def _write_file(path: Path, data: memoryview, step: int) -> tuple[float, float]:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        started = time.perf_counter()
        written = flushed = 0
        while written < len(data):
            written += os.write(fd, data[written : written + _CHUNK])
            if step and written - flushed >= step:
                start_writeback(fd, offset=flushed, length=written - flushed)
                flushed = written
        wrote = time.perf_counter()
        os.fsync(fd)
        return wrote - started, time.perf_counter() - wrote
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)


def probe(directory: Path, *, nbytes: int = _PROBE_BYTES, reps: int = 3) -> Probe:
    """Measure ``directory``'s storage: one thread's SHA-256 rate, and writing + fsyncing ``nbytes`` there.

    The file is hidden (``.shardline-probe-<hex>``) and removed before this returns.

    Raises:
        OSError: the file could not be written or flushed (e.g. the disk is full).
    """
    data = memoryview(np.random.default_rng(0).bytes(nbytes))
    hash_s = float("inf")
    for _ in range(reps):
        started = time.perf_counter()
        hashlib.sha256(data).digest()
        hash_s = min(hash_s, time.perf_counter() - started)
    best: dict[int, tuple[float, float]] = {}
    started = time.monotonic()
    for rep in range(reps):
        for step in _STEPS if rep % 2 == 0 else _STEPS[::-1]:  # alternating, so drift hits every way alike
            if best and time.monotonic() - started > _PROBE_BUDGET_S:  # a very slow disk: decide on what was seen
                return Probe(nbytes=nbytes, hash_s=hash_s, steps=best)
            write, flush = _write_file(directory / f".shardline-probe-{uuid.uuid4().hex[:12]}", data, step)
            if step not in best or write + flush < sum(best[step]):
                best[step] = (write, flush)
    return Probe(nbytes=nbytes, hash_s=hash_s, steps=best)


def cache_path() -> Path:
    """The calibration cache: ``$XDG_CACHE_HOME/shardline/save-calibration.json`` (default ``~/.cache``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "shardline" / "save-calibration.json"


def _location_key(directory: Path) -> str:
    st = os.stat(directory)
    try:
        fsid = os.statvfs(directory).f_fsid
    except (OSError, AttributeError):  # not POSIX
        fsid = 0
    return f"{socket.gethostname()}:dev{st.st_dev}:fsid{fsid}"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[bool]:
    """Hold an exclusive lock on ``path`` (True), or go on without one where locking is impossible (False)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield False
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.with_suffix(".lock"), os.O_CREAT | os.O_RDWR, 0o644)
    try:
        deadline = time.monotonic() + _LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:  # another process probes a very slow disk: do not wait on it
                    yield False
                    return
                time.sleep(0.02)
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _read_cache(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    entries = data.get("entries") if isinstance(data, dict) else None
    return entries if isinstance(entries, dict) else {}


def _cached_probe(entry: object, now: float) -> Probe | None:
    if not isinstance(entry, dict) or entry.get("format") != _FORMAT:
        return None
    try:
        if not 0 <= now - float(entry["measured_at"]) <= MAX_AGE_S:
            return None
        return Probe.from_json(entry["probe"])
    except (KeyError, TypeError, ValueError, IndexError):
        return None


# Note: a save asks for its tuning every time, and the cache file changes only when a process probes. The entry
# this process read (or wrote) last is kept per cache file and location with the file's identity (inode, size,
# modification time); while a stat shows the same identity, the file is not locked, opened and parsed again.
# Its age is checked at every use, as the file's is.
_SEEN: dict[tuple[str, str], tuple[tuple[int, int, int] | None, object]] = {}


def _version(path: Path) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def _seen_entry(cache: Path, key: str) -> object:
    """The cache entry this process last read for ``key``, if the cache file has not changed since (else None)."""
    seen = _SEEN.get((str(cache), key))
    if seen is None or seen[0] is None or seen[0] != _version(cache):
        return None
    return seen[1]


def _write_cache(path: Path, entries: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:12]}")
    try:
        tmp.write_text(json.dumps({"entries": entries}, indent=1, sort_keys=True))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def tuning_for(directory: Path, *, writers: int, cores: int) -> SaveTuning:
    """The tuning for a rank saving ``writers`` files into ``directory`` with ``cores`` cores (see the module note).

    The probe (written into ``directory`` itself, so on the checkpoint's own file system) runs when
    the cache has no fresh entry for that file system, or always with ``SHARDLINE_SAVE_CALIBRATION=force``.
    Never raises for a probe or cache that fails: the fixed behaviour is used instead.

    Raises:
        ConfigurationError: ``SHARDLINE_SAVE_CALIBRATION`` is set to something other than auto, off or force.
    """
    mode = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if mode not in ("auto", "off", "force"):
        raise ConfigurationError(
            f"{ENV}={os.environ[ENV]!r} is not a calibration mode: use auto (the default: probe each file system "
            "once and cache it), off (no probe: the fixed behaviour) or force (probe at every save)"
        )
    if mode == "off":
        return fixed_tuning(writers=writers, cores=cores)
    cache = cache_path()
    try:
        key = _location_key(directory)
    except OSError as e:
        return fixed_tuning(writers=writers, cores=cores, source="fallback", reason=f"cannot stat {directory}: {e}")
    now = time.time()
    if mode == "auto":
        seen = _cached_probe(_seen_entry(cache, key), now)
        if seen is not None:
            return decide(seen, writers=writers, cores=cores, source="cached")
    try:
        with _locked(cache):
            version = _version(cache)  # before the read: a file replaced meanwhile only looks changed next time
            entries = _read_cache(cache)
            _SEEN[(str(cache), key)] = (version, entries.get(key))
            cached = None if mode == "force" else _cached_probe(entries.get(key), now)
            if cached is not None:
                return decide(cached, writers=writers, cores=cores, source="cached")
            measured = probe(directory)
            entries[key] = {
                "format": _FORMAT,
                "measured_at": now,
                "directory": str(directory),
                "probe": measured.to_json(),
            }
            with contextlib.suppress(OSError):
                _write_cache(cache, entries)
                _SEEN[(str(cache), key)] = (_version(cache), entries[key])
            tuning = decide(measured, writers=writers, cores=cores)
            log.info("save calibration for %s (cached in %s): %s", directory, cache, tuning.reason)
            return tuning
    except OSError as e:  # the probe could not write (a full disk) or the cache directory is not writable
        return fixed_tuning(writers=writers, cores=cores, source="fallback", reason=f"calibration failed: {e}")
