"""How a save's local files reach the disk: writeback started as they grow, rank 0's flushes behind its commit records.

Durability is unchanged by either: every file is fsynced before the rename commits the
checkpoint. These tests prove that order on real files, and that a flush failing in the
background fails the save closed.
"""

from __future__ import annotations

import errno
import hashlib
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import shardline.checkpoint as ckpt
from shardline.checkpoint.integrity import hashing
from shardline.checkpoint.integrity.hashing import HashingFileSystem
from shardline.checkpoint.storage import fsutil
from shardline.errors import DiskFullError

MIB = 1 << 20


def _fd_path(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


linux_only = pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="reads /proc/self/fd (Linux)")


@linux_only
def test_writeback_is_started_as_the_file_grows_and_its_fsync_still_ends_it(tmp_path: Path, monkeypatch) -> None:
    started: list[tuple[int, int]] = []
    synced: list[tuple[str, int]] = []
    real_start, real_fsync = hashing.start_writeback, os.fsync

    def spy_start(fd: int, *, offset: int, length: int) -> bool:
        started.append((offset, length))
        assert os.fstat(fd).st_size >= offset + length, "only bytes that reached the OS are handed to writeback"
        return real_start(fd, offset=offset, length=length)

    def spy_fsync(fd: int) -> None:
        synced.append((_fd_path(fd), len(started)))
        real_fsync(fd)

    monkeypatch.setattr(hashing, "start_writeback", spy_start)
    monkeypatch.setattr(os, "fsync", spy_fsync)
    fs = HashingFileSystem()
    data = [torch.randn(MIB).numpy().tobytes() for _ in range(5)]  # 4 MiB each
    small = bytearray(b"s" * 100)
    target = tmp_path / "f.distcp"
    with fs.create_stream(target, "wb") as stream:
        for chunk in data:
            stream.write(chunk)
            stream.write(small)  # a small buffer the caller reuses at once: copied, hashed in file order
            small[:10] = b"0123456789"
    content = target.read_bytes()
    assert fs.take()[str(target)] == (len(content), hashlib.sha256(content).hexdigest())
    # The hints run on the fsync threads (storage/writeback.py): ranges that wait behind a call in progress are
    # merged, and those still waiting at close are left to the fsync.
    assert 1 <= len(started) <= 5
    n = len(started)
    assert [offset for offset, _ in started] == [sum(k for _, k in started[:i]) for i in range(n)]  # contiguous
    assert all(length >= hashing._WRITEBACK_EVERY for _, length in started)
    assert synced == [(str(target), n)], "one fsync, at close, after every writeback hint"


@linux_only
def test_start_writeback_reports_what_cannot_be_flushed(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x" * 4096)
    fd = os.open(path, os.O_RDWR)
    try:
        assert fsutil.start_writeback(fd, offset=0, length=4096)
    finally:
        os.close(fd)
    read_end, write_end = os.pipe()
    try:
        assert not fsutil.start_writeback(write_end, offset=0, length=4096)  # a pipe: ESPIPE, never asked again
    finally:
        os.close(read_end)
        os.close(write_end)


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512))  # unwrapped: one process, no group
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, 512)).sum().backward()
    optimizer.step()
    return model, optimizer


@linux_only
def test_rank0_commits_only_after_its_data_files_flushed_in_the_background(tmp_path: Path, monkeypatch) -> None:
    """The data files' fsyncs overlap .metadata and the records; every one ends before the rename."""
    model, optimizer = _model()
    events: list[tuple[float, str, str]] = []
    lock = threading.Lock()
    real_fsync, real_rename = os.fsync, os.rename

    def log(kind: str, what: str) -> None:
        with lock:
            events.append((time.monotonic(), kind, what))

    def slow_fsync(fd: int) -> None:
        name = Path(_fd_path(fd)).name
        log("fsync>", name)
        if name.endswith(".distcp"):
            time.sleep(0.3)  # a slow disk: the commit records are written meanwhile
        real_fsync(fd)
        log("fsync<", name)

    def spy_rename(src, dst) -> None:
        log("rename", Path(dst).name)
        real_rename(src, dst)

    monkeypatch.setattr(os, "fsync", slow_fsync)
    monkeypatch.setattr(os, "rename", spy_rename)
    info = ckpt.save(tmp_path / "step-1", model=model, optimizer=optimizer, step=1, files_per_rank=2)
    commit = next(t for t, kind, what in events if kind == "rename" and what == "step-1")
    data_done = [t for t, kind, what in events if kind == "fsync<" and what.endswith(".distcp")]
    assert len(data_done) == 2, events
    assert max(data_done) < commit, events
    # .metadata is flushed once, by its own stream in the background (under DCP's temporary name or its own)
    metadata_flushed = next(t for t, kind, what in events if kind == "fsync<" and what.startswith(".metadata"))
    first_data_start = min(t for t, kind, what in events if kind == "fsync>" and what.endswith(".distcp"))
    assert first_data_start < metadata_flushed < max(data_done), "the records were flushed while the data flushed"
    assert metadata_flushed < commit
    assert ckpt.verify_checkpoint(info.path).ok


@linux_only
def test_a_background_flush_that_fails_fails_the_save_closed(tmp_path: Path, monkeypatch) -> None:
    """ENOSPC from a data file's fsync (delayed allocation): DiskFullError, nothing committed, nothing left behind."""
    model, optimizer = _model()
    directory = tmp_path / "checkpoints"
    first = ckpt.save(directory / "step-1", model=model, optimizer=optimizer, step=1)
    real_fsync = os.fsync

    def full_fsync(fd: int) -> None:
        if _fd_path(fd).endswith(".distcp"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", full_fsync)
    with pytest.raises(DiskFullError) as failure:
        ckpt.save(
            directory / "step-2", model=model, optimizer=optimizer, step=2, parent_manifest_hash=first.manifest_hash
        )
    message = str(failure.value).splitlines()[0]
    assert message.startswith(f"disk full: writing checkpoint {directory / 'step-2'} needs about "), message
    assert "No space left on device" in message, message
    assert ".distcp" in message, message
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert sorted(p.name for p in directory.iterdir()) == ["step-1"], "no step-2, no temporary directory, no lock"
    assert ckpt.verify_checkpoint(directory / "step-1").ok
