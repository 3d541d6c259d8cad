"""A real full disk: a small tmpfs fills during a save, sync and async, and the error says so.

The tmpfs is mounted in a mount namespace of its own (``unshare``), so nothing outside the
child process sees it and it goes away with the child; the test is skipped where the kernel
allows no such namespace.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SIZE = re.compile(r"needs about ([\d.]+) ([KMG]?B), ([\d.]+) ([KMG]?B) free on ")
UNITS = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9}


def _can_mount_tmpfs(where: Path) -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs '{where}'"], capture_output=True, timeout=20
    )
    return probe.returncode == 0


def _bytes(number: str, unit: str) -> float:
    return float(number) * UNITS[unit]


def test_full_tmpfs_named_in_sync_and_async_saves(tmp_path: Path) -> None:
    mount = tmp_path / "small"
    mount.mkdir()
    if not _can_mount_tmpfs(mount):
        pytest.skip("this kernel allows no user mount namespace (unshare -rm), so no small tmpfs can be mounted")
    directory = mount / "checkpoints"
    script = (
        f"mount -t tmpfs -o size=8m tmpfs '{mount}' && "
        f"exec '{sys.executable}' -m tests.checkpoint.full_disk '{directory}' '{tmp_path / 'lineage.sqlite'}'"
    )
    done = subprocess.run(["unshare", "-rm", "sh", "-c", script], cwd=REPO, capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    for mode in ("sync", "async"):
        kind, message = out[mode]
        assert kind == "DiskFullError", (mode, kind, message)
        first = message.splitlines()[0]
        assert first.startswith(f"disk full: writing checkpoint {directory / 'step-2'} needs about "), (mode, first)
        assert "unexpected pos" not in message, (mode, message)
        assert "enforce fail" not in message, (mode, message)
        assert f"the last good checkpoint is {directory / 'step-1'}" in first, (mode, first)
        need, need_unit, free, free_unit = SIZE.search(first).groups()
        # bytes needed: the state saved, within 10% of what step-1 (the same state) takes on disk
        assert abs(_bytes(need, need_unit) - out["step1_bytes"]) < 0.1 * out["step1_bytes"], (mode, first)
        # bytes free: what the file system had before the save (about half a checkpoint), within 10%
        assert abs(_bytes(free, free_unit) - out["free_before"]) < 0.1 * out["free_before"] + 64 * 1024, (mode, first)
        # nothing half-written is left: the temporary directory went, step-1 stays
        assert [n for n in out[f"left_after_{mode}"] if n.startswith(".step-2")] == [], out
        assert "step-1" in out[f"left_after_{mode}"], out
        assert "step-2" not in out[f"left_after_{mode}"], out
