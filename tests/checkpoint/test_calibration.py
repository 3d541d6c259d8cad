"""The save's calibration: how a location's local files are hashed and flushed is measured there once and cached.

The decision is a pure function of the probe (checked on probes shaped like a slow disk, a
fast one and tmpfs); the cache is keyed by host and file system, refreshed when stale or
forced, bypassed when off; a save uses the tuning its location measured.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from shardline.checkpoint.integrity import hashing
from shardline.checkpoint.integrity.hashing_writer import HashingWriter
from shardline.checkpoint.storage import calibration
from shardline.checkpoint.storage.calibration import Probe, decide, tuning_for
from shardline.errors import ConfigurationError

MIB = 1 << 20
N = 32 * MIB
# (write, fsync) seconds for 32 MiB, per writeback step (0: none), and one thread's SHA-256 of 32 MiB: 22 ms.
SLOW_DISK = Probe(nbytes=N, hash_s=0.022, steps={0: (0.020, 0.090), 4 * MIB: (0.024, 0.045), 16 * MIB: (0.022, 0.060)})
FAST_DISK = Probe(nbytes=N, hash_s=0.022, steps={0: (0.020, 0.012), 4 * MIB: (0.024, 0.011), 16 * MIB: (0.022, 0.011)})
TMPFS = Probe(nbytes=N, hash_s=0.022, steps={0: (0.015, 0.0), 4 * MIB: (0.016, 0.0), 16 * MIB: (0.015, 0.0)})


def test_a_slow_flush_hides_the_hash_and_a_short_one_does_not() -> None:
    slow = decide(SLOW_DISK, writers=2, cores=2)
    # 45 ms of flush after the writes against 11 ms of hashing on two threads: hash from the fsync on, and start
    # the writeback every 4 MiB (69 ms against 110 ms for the fsync alone).
    assert (slow.hash_during_writes, slow.writeback_every, slow.hash_threads) == (False, 4 * MIB, 2)
    fast = decide(FAST_DISK, writers=2, cores=2)
    # 11-12 ms of flush cannot hide 11 ms of hash with the margin; early writeback gains under 5%: left to the fsync.
    assert (fast.hash_during_writes, fast.writeback_every) == (True, None)
    noisy = Probe(nbytes=N, hash_s=0.022, steps={0: (0.020, 0.0002), 4 * MIB: (0.015, 0.0001), 16 * MIB: (0.02, 0.0)})
    assert decide(noisy, writers=2, cores=2).writeback_every is None, "a free fsync has nothing to shorten"
    shm = decide(TMPFS, writers=2, cores=2)
    assert (shm.hash_during_writes, shm.writeback_every) == (True, None)
    assert "flush is shorter than the hash" in shm.reason
    assert "22.0 ms" in shm.reason
    # A core left free during the writes is used for the hash whatever the disk.
    assert decide(SLOW_DISK, writers=1, cores=2).hash_during_writes
    # One core writing one file: the hash (22 ms) against the slow disk's 45 ms tail still hides.
    assert not decide(SLOW_DISK, writers=1, cores=1).hash_during_writes


class _Probes:
    def __init__(self, result: Probe | None = None) -> None:
        self.calls: list[Path] = []
        self.result = result or SLOW_DISK

    def __call__(self, directory: Path) -> Probe:
        self.calls.append(directory)
        return self.result


def test_a_location_is_probed_once_and_cached_per_file_system(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(calibration.ENV, raising=False)
    target = tmp_path / "ckpt"
    target.mkdir()
    first = tuning_for(target, writers=2, cores=2)  # the real probe, in the target directory
    assert first.source == "measured"
    assert list(target.iterdir()) == [], "the probe's file is removed"
    cache = json.loads(calibration.cache_path().read_text())
    (entry,) = cache["entries"].values()
    assert entry["directory"] == str(target)
    assert entry["probe"]["nbytes"] == 32 * MIB

    probes = _Probes()
    monkeypatch.setattr(calibration, "probe", probes)
    other = tmp_path / "other"  # the same file system: the cached probe answers
    other.mkdir()
    again = tuning_for(other, writers=2, cores=2)
    assert again.source == "cached"
    assert probes.calls == []
    assert again == decide(Probe.from_json(entry["probe"]), writers=2, cores=2, source="cached")

    monkeypatch.setenv(calibration.ENV, "force")  # measured again, and the cache refreshed
    assert tuning_for(other, writers=2, cores=2).source == "measured"
    assert probes.calls == [other]
    (entry,) = json.loads(calibration.cache_path().read_text())["entries"].values()
    assert entry["probe"] == SLOW_DISK.to_json()

    monkeypatch.setenv(calibration.ENV, "off")  # the fixed behaviour, nothing probed
    off = tuning_for(other, writers=2, cores=2)
    assert (off.source, off.hash_during_writes, off.writeback_every) == ("fixed", False, 4 * MIB)
    assert len(probes.calls) == 1

    monkeypatch.delenv(calibration.ENV)
    stale = json.loads(calibration.cache_path().read_text())
    for item in stale["entries"].values():
        item["measured_at"] = time.time() - calibration.MAX_AGE_S - 60
    calibration.cache_path().write_text(json.dumps(stale))
    assert tuning_for(other, writers=2, cores=2).source == "measured"
    assert len(probes.calls) == 2

    monkeypatch.setattr(calibration, "_location_key", lambda directory: "elsewhere:dev1:fsid2")
    assert tuning_for(other, writers=2, cores=2).source == "measured"
    assert len(probes.calls) == 3
    assert len(json.loads(calibration.cache_path().read_text())["entries"]) == 2


def test_a_failed_probe_falls_back_to_the_fixed_behaviour_and_caches_nothing(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(calibration.ENV, raising=False)

    def full(directory: Path) -> Probe:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(calibration, "probe", full)
    tuning = tuning_for(tmp_path, writers=2, cores=2)
    assert tuning.source == "fallback"
    assert "No space left" in tuning.reason
    assert (tuning.hash_during_writes, tuning.writeback_every) == (False, 4 * MIB)
    assert not calibration.cache_path().exists()


@pytest.mark.parametrize(("probe", "eager", "writeback"), [(SLOW_DISK, False, 4 * MIB), (TMPFS, True, None)])
def test_a_save_hashes_and_flushes_as_its_location_measured(tmp_path, monkeypatch, probe, eager, writeback) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(calibration.ENV, raising=False)
    monkeypatch.setattr(calibration, "probe", _Probes(probe))
    streams: list[tuple[bool, int | None]] = []
    real = hashing._HashingStream.__init__

    def spy(self, *args, eager: bool = False, sync=None, writeback_every=None, **kwargs) -> None:
        streams.append((eager, writeback_every))
        real(self, *args, eager=eager, sync=sync, writeback_every=writeback_every, **kwargs)

    monkeypatch.setattr(hashing._HashingStream, "__init__", spy)
    monkeypatch.setattr("shardline.checkpoint.integrity.hashing_writer.cores_per_rank", lambda: 2)
    state = {"a": torch.randn(1024, 1024), "b": torch.randn(1024, 1024)}
    target = tmp_path / "ckpt"
    writer = HashingWriter(target, files_per_rank=2)
    dcp.save(state, storage_writer=writer, no_dist=True)
    assert writer.tuning is not None
    assert writer.tuning.source == "measured"
    data_files = streams[:-1]  # the last stream is .metadata
    assert data_files == [(eager, writeback)] * 2
    for record in writer.file_digests:
        content = (target / record.path).read_bytes()
        assert (record.bytes, record.sha256) == (len(content), hashlib.sha256(content).hexdigest())
    assert sorted(os.listdir(target)) == sorted(r.path for r in writer.file_digests)


def test_a_slow_disk_is_probed_within_a_budget(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(calibration, "_PROBE_BUDGET_S", 0.0)  # every write "takes too long": stop after the first
    measured = calibration.probe(tmp_path, nbytes=4 * MIB)
    assert list(measured.steps) == [0]
    assert list(tmp_path.iterdir()) == []
    tuning = decide(measured, writers=2, cores=2)
    assert tuning.writeback_every is None
    assert decide(Probe(nbytes=N, hash_s=0.022, steps={4 * MIB: (0.02, 0.09)}), writers=2, cores=2).writeback_every


def test_an_unknown_calibration_mode_is_refused_by_name(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(calibration.ENV, "of")
    with pytest.raises(
        ConfigurationError, match=r"SHARDLINE_SAVE_CALIBRATION='of' is not a calibration mode: use auto"
    ):
        tuning_for(tmp_path, writers=2, cores=2)
