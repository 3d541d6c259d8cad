"""Early-writeback hints are asked for on the fsync threads: a hint that waits for the disk never stalls the writer."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import pytest
import torch

from shardline.checkpoint.integrity import hashing
from shardline.checkpoint.integrity.hashing import HashingFileSystem
from shardline.checkpoint.storage.writeback import BackgroundWriteback

MIB = 1 << 20


def _chunks(count: int) -> list[bytes]:
    return [torch.randn(MIB).numpy().tobytes() for _ in range(count)]  # 4 MiB each: one hint per chunk


def test_writeback_hints_run_off_the_writer_thread_in_file_order(tmp_path: Path, monkeypatch) -> None:
    calls: list[tuple[int, int, int]] = []

    def spy(fd: int, *, offset: int, length: int) -> bool:
        assert os.fstat(fd).st_size >= offset + length, "only bytes that reached the OS are handed to writeback"
        calls.append((threading.get_ident(), offset, length))
        return True

    monkeypatch.setattr(hashing, "start_writeback", spy)
    fs = HashingFileSystem()
    data = _chunks(5)
    target = tmp_path / "f.distcp"
    writer = threading.get_ident()
    with fs.create_stream(target, "wb") as stream:
        for chunk in data:
            stream.write(chunk)
    content = target.read_bytes()
    assert fs.take()[str(target)] == (len(content), hashlib.sha256(content).hexdigest())
    assert calls, "the file's writeback was started early"
    assert all(thread != writer for thread, _, _ in calls), "a writeback hint ran on the thread writing the file"
    offsets = [offset for _, offset, _ in calls]
    assert offsets == [sum(n for _, _, n in calls[:i]) for i in range(len(calls))], "hints in file order, contiguous"


def test_a_writeback_hint_that_waits_for_the_disk_does_not_stall_the_writes(tmp_path: Path, monkeypatch) -> None:
    release = threading.Event()
    entered = threading.Event()
    calls: list[tuple[int, int]] = []

    def congested(fd: int, *, offset: int, length: int) -> bool:
        calls.append((offset, length))
        entered.set()
        release.wait(timeout=30)  # a full disk queue: sync_file_range waits for room
        return True

    monkeypatch.setattr(hashing, "start_writeback", congested)
    fs = HashingFileSystem()
    data = _chunks(6)
    target = tmp_path / "f.distcp"
    wrote_all = threading.Event()

    def write() -> None:
        with fs.create_stream(target, "wb") as stream:
            for chunk in data:
                stream.write(chunk)
            wrote_all.set()
            release.wait(timeout=30)

    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    try:
        assert entered.wait(timeout=20), "the file's writeback was started early"
        assert wrote_all.wait(timeout=20), "the writer waited for a writeback hint the disk had not answered"
        assert len(calls) == 1, "the later ranges wait behind the call in progress, merged"
    finally:
        release.set()
        thread.join(timeout=30)
    assert not thread.is_alive()
    content = target.read_bytes()
    assert len(content) == 6 * 4 * MIB
    assert fs.take()[str(target)] == (len(content), hashlib.sha256(content).hexdigest())
    assert calls[0][0] == 0
    if len(calls) > 1:  # the merged rest, if the drain reached it before the close dropped it
        assert calls[1][0] == calls[0][1]
        assert calls[1][1] >= 4 * 4 * MIB


def test_a_file_that_cannot_be_flushed_early_is_not_asked_again(tmp_path: Path) -> None:
    seen: list[int] = []
    answered = threading.Event()

    def refuse(fd: int, *, offset: int, length: int) -> bool:
        seen.append(offset)
        answered.set()
        return False

    path = tmp_path / "f"
    with open(path, "wb") as f:
        queue = BackgroundWriteback(f.fileno(), start=refuse)
        assert queue.request(offset=0, length=10)
        assert answered.wait(timeout=20)
        queue.close()
        assert not queue.request(offset=10, length=10), "refused once: never asked again"
    assert seen == [0]


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts /proc/self/fd (Linux)")
def test_a_file_closes_and_is_flushed_without_waiting_for_a_hint_in_progress(tmp_path: Path, monkeypatch) -> None:
    """The close drops the ranges not yet asked for and fsyncs at once; the hint still in the disk's queue releases
    its own descriptor when it returns (none is leaked)."""
    release = threading.Event()
    entered = threading.Event()

    def congested(fd: int, *, offset: int, length: int) -> bool:
        entered.set()
        release.wait(timeout=30)  # a full disk queue: sync_file_range waits for room
        return True

    flushed: list[int] = []
    real_fsync = os.fsync

    def spy(fd: int) -> None:
        flushed.append(os.fstat(fd).st_ino)
        real_fsync(fd)

    monkeypatch.setattr(hashing, "start_writeback", congested)
    monkeypatch.setattr(os, "fsync", spy)
    fs = HashingFileSystem()
    target = tmp_path / "f.distcp"
    before = _open_fds()
    closed = threading.Event()

    def write() -> None:
        with fs.create_stream(target, "wb") as stream:
            for chunk in _chunks(3):
                stream.write(chunk)
            assert entered.wait(timeout=20), "the file's writeback was started early"
        closed.set()

    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    try:
        assert closed.wait(timeout=10), "the close waited for a writeback hint the disk had not answered"
        assert flushed == [target.stat().st_ino], "the file was fsynced at its close, beside the hint"
        assert _open_fds() == before + 1, "only the hint's own descriptor is still open, while its call runs"
    finally:
        release.set()
        thread.join(timeout=30)
    for _ in range(200):
        if _open_fds() == before:
            break
        threading.Event().wait(0.01)
    assert _open_fds() == before, "the hint's descriptor was released when its call returned"
    content = target.read_bytes()
    assert fs.take()[str(target)] == (len(content), hashlib.sha256(content).hexdigest())
