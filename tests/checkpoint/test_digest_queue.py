"""Hashing that trails the write: in file order, only over memory that keeps its bytes, finished at close."""

from __future__ import annotations

import hashlib
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from shardline.checkpoint.integrity import digest_queue
from shardline.checkpoint.integrity.digest_queue import OrderedDigest, RetainedMemory
from shardline.checkpoint.integrity.hashing import HashingFileSystem

MIB = 1 << 20


@pytest.fixture(scope="module")
def pool():
    with ThreadPoolExecutor(max_workers=2) as p:
        yield p


def _view(tensor: torch.Tensor, start: int = 0, length: int | None = None) -> memoryview:
    """A view of part of a tensor's memory."""
    return memoryview(tensor.numpy().view(np.uint8).reshape(-1))[start : None if length is None else start + length]


def test_updates_run_in_order_whatever_path_each_buffer_takes(pool) -> None:
    rng = np.random.default_rng(0)
    chunks = [rng.integers(0, 256, size=n, dtype=np.uint8).tobytes() for n in (5, 3 * MIB, 17, 2 * MIB + 1, 4096, MIB)]
    for eager in (True, False):
        digest = OrderedDigest(pool, eager=eager)
        for i, chunk in enumerate(chunks):
            if i % 3 == 2:
                digest.now(memoryview(bytearray(chunk)), lambda: None)  # a buffer the caller may reuse
            else:
                digest.later(memoryview(chunk))
        assert digest.hexdigest() == hashlib.sha256(b"".join(chunks)).hexdigest()


def test_a_lazy_queue_is_not_hashed_before_it_is_started(pool) -> None:
    digest = OrderedDigest(pool, eager=False)
    hashed = threading.Event()
    real = digest._hash

    class Spy:
        def update(self, data):
            hashed.set()
            real.update(data)

        def hexdigest(self):
            return real.hexdigest()

    digest._hash = Spy()
    digest.later(b"x" * MIB)
    assert not hashed.wait(0.2)  # queued, not hashed: the writer's cores are left to the writes
    digest.start()
    assert hashed.wait(5)
    assert digest.hexdigest() == hashlib.sha256(b"x" * MIB).hexdigest()


def test_a_failing_update_is_raised_in_the_writers_thread(pool) -> None:
    digest = OrderedDigest(pool)
    digest.later(object())  # not a buffer: hashlib raises TypeError on the helper thread
    with pytest.raises(TypeError):
        digest.hexdigest()


def test_retained_memory_covers_only_the_storages_it_holds() -> None:
    retained = RetainedMemory()
    kept = torch.arange(MIB, dtype=torch.float32)
    other = torch.arange(MIB, dtype=torch.float32)
    retained.keep(kept)
    inside = _view(kept, 4096, MIB)
    assert retained.covers(inside)
    outside = _view(other, 0, MIB)
    assert not retained.covers(outside)
    assert not retained.covers(memoryview(np.empty(0, np.uint8)))
    many = [torch.arange(1024 + i, dtype=torch.float32) for i in range(50)]  # kept in any order: a sorted lookup
    for t in reversed(many):
        retained.keep(t)
    retained.keep(many[7])  # tied weights: the same storage twice
    assert all(retained.covers(_view(t)) for t in many)
    assert all(retained.covers(_view(t, 4 * 1000, 4 * 24)) for t in many)
    copied = memoryview(np.frombuffer(many[3].numpy().tobytes(), np.uint8))  # same bytes, in no kept storage
    assert not retained.covers(copied)
    retained.release()
    assert not retained.covers(inside)


def test_a_stream_hashes_the_bytes_it_wrote_on_every_path(tmp_path: Path) -> None:
    """Raw retained tensor memory, raw memory not retained, bytes, a reused bytearray: the file's digest is exact."""
    fs = HashingFileSystem()
    kept = torch.randn(MIB)  # 4 MiB, retained: queued without a copy
    fs.retained.keep(kept)
    loose = torch.randn(MIB // 2)  # 2 MiB, not retained: hashed before write returns
    reused = bytearray(b"a" * (2 * MIB))
    target = tmp_path / "f.distcp"
    with fs.create_stream(target, "wb") as stream:
        stream.write(kept.numpy().view(np.uint8).reshape(-1).data)
        stream.write(b"header" * 10)
        stream.write(loose.numpy().view(np.uint8).reshape(-1).data)
        stream.write(reused)
        reused[:] = b"b" * len(reused)  # the caller reuses its buffer as soon as write returned
        stream.write(reused)
        stream.fileno()  # what DCP's writer does before fsync: the lazy queue starts
    size, digest = fs.take()[str(target)]
    data = target.read_bytes()
    assert size == len(data)
    assert digest == hashlib.sha256(data).hexdigest()
    fs.retained.release()


def test_the_address_of_a_read_only_buffer_is_its_first_byte() -> None:
    array = np.arange(64, dtype=np.uint8)
    view = memoryview(array.tobytes())
    assert digest_queue._address(memoryview(array)[8:]) == array.ctypes.data + 8
    assert digest_queue._address(view) != 0


def test_a_dcp_save_queues_every_tensor_without_copying_it(tmp_path: Path, monkeypatch) -> None:
    """Through DCP and torch.save: every large buffer is a retained tensor's memory, and each digest is exact."""
    import torch.distributed.checkpoint as dcp

    from shardline.checkpoint.integrity.hashing_writer import HashingWriter

    paths: dict[str, int] = {"later": 0, "now": 0}
    later, now = OrderedDigest.later, OrderedDigest.now

    def spy_later(self, buffer):
        if memoryview(buffer).nbytes >= MIB:
            paths["later"] += memoryview(buffer).nbytes
        return later(self, buffer)

    def spy_now(self, buffer, write):
        paths["now"] += buffer.nbytes
        return now(self, buffer, write)

    monkeypatch.setattr(OrderedDigest, "later", spy_later)
    monkeypatch.setattr(OrderedDigest, "now", spy_now)
    big = torch.randn(4096, 256)
    state = {"a": torch.randn(512, 1024), "b": big[:, :128], "c": torch.randn(3)}  # b: a view DCP must clone
    writer = HashingWriter(tmp_path, files_per_rank=2)
    dcp.save(state, storage_writer=writer, no_dist=True)
    assert paths == {"later": 512 * 1024 * 4 + 4096 * 128 * 4, "now": 0}
    for record in writer.file_digests:
        data = (tmp_path / record.path).read_bytes()
        assert (record.bytes, record.sha256) == (len(data), hashlib.sha256(data).hexdigest())
    loaded = {"a": torch.empty(512, 1024), "b": torch.empty(4096, 128), "c": torch.empty(3)}
    dcp.load(loaded, checkpoint_id=tmp_path, no_dist=True)
    assert torch.equal(loaded["b"], big[:, :128])
    assert torch.equal(loaded["a"], state["a"])


def test_a_discarded_digest_reads_no_buffer_afterwards(pool) -> None:
    """After a failed write the queue is dropped and the update in progress finished, before memory is released."""
    reading = threading.Event()
    release = threading.Event()

    class Slow:
        def __init__(self) -> None:
            self.seen = 0

        def update(self, data):
            reading.set()
            release.wait(5)
            self.seen += 1

    digest = OrderedDigest(pool, eager=True)
    digest._hash = slow = Slow()
    digest.later(b"a")  # taken by the helper thread, which blocks inside update
    assert reading.wait(5)
    digest.later(b"b")
    digest.later(b"c")
    threading.Timer(0.2, release.set).start()
    digest.discard()  # returns only once the update in progress is over
    assert slow.seen == 1  # "b" and "c" were dropped, never read
    assert not digest._draining
    lazy = OrderedDigest(pool, eager=False)
    lazy.later(b"x")
    lazy.discard()  # never started: nothing to wait for
    assert not lazy._queue


def test_a_small_file_is_hashed_on_the_thread_that_closes_it(tmp_path: Path, monkeypatch, pool) -> None:
    """A file of a few KiB (``.metadata``) is hashed where it is closed, without a helper thread; a large one still
    on the hasher pool."""
    drained: list[int] = []
    real = digest_queue.OrderedDigest._drain

    def spy(self: OrderedDigest) -> None:
        drained.append(threading.get_ident())
        real(self)

    monkeypatch.setattr(digest_queue.OrderedDigest, "_drain", spy)
    fs = HashingFileSystem()
    small = np.random.default_rng(1).integers(0, 256, size=3243, dtype=np.uint8).tobytes()
    with fs.create_stream(tmp_path / ".metadata", "wb") as stream:
        stream.write(small[:100])
        stream.write(small[100:])
    assert fs.take()[str(tmp_path / ".metadata")] == (len(small), hashlib.sha256(small).hexdigest())
    assert drained == [], "a small file's hash was handed to a helper thread"

    digest = OrderedDigest(pool, eager=False)
    digest.later(b"x" * MIB)  # a long queue: hashed on the pool once started
    digest.start()
    assert digest.hexdigest() == hashlib.sha256(b"x" * MIB).hexdigest()
    assert drained, "a long queue is hashed on the pool"
    assert threading.get_ident() not in drained
