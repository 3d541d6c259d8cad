"""Async saves write exactly the bytes they staged: a staged copy that changes before the write is caught."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

import shardline.checkpoint as ckpt
from shardline.checkpoint.faults.observer import SaveObserver
from shardline.checkpoint.integrity.copy_check import digest_staged
from shardline.checkpoint.lifecycle import capture
from shardline.errors import CheckpointError


class _HoldWrites(SaveObserver):
    """Blocks the background writer at its first write until the test lets it go."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def before_write(self, path: str, nbytes: int, rank: int) -> None:
        assert self.release.wait(30), "the test never released the writer"


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 4))


def test_a_staged_copy_that_is_not_a_copy_is_caught(tmp_path: Path, monkeypatch) -> None:
    directory = tmp_path / "checkpoints"
    model = _model()
    manager = ckpt.CheckpointManager(directory, async_save=True)
    manager.save(ckpt.SaveRequest(step=1, model=model))
    manager.wait()
    # pytorch#144657: staging that hands the writer the live tensors instead of copies
    monkeypatch.setattr(capture, "_snapshot", lambda sd, **_: sd)
    hold = _HoldWrites()
    manager.observer = hold
    manager.save(ckpt.SaveRequest(step=2, model=model))  # returns once "staged"
    with torch.no_grad():
        model[0].weight.add_(1.0)  # training goes on and updates the weights in place
    hold.release.set()
    with pytest.raises(CheckpointError, match=r"differ from what it staged -- model\.0\.weight: the bytes written"):
        manager.wait()
    assert not (directory / "step-2").exists()  # nothing committed
    assert [p.name for p in directory.iterdir() if p.name.startswith(".step-2")] == []
    assert ckpt.verify_checkpoint(directory / "step-1").ok  # the previous checkpoint is intact
    assert [r.step for r in ckpt.Ledger(directory / "lineage.sqlite").rows()] == [1]


def test_real_copies_pass_and_every_tensor_is_compared(tmp_path: Path, monkeypatch) -> None:
    from shardline.checkpoint.integrity import copy_check

    compared: list[int] = []
    real = copy_check._written_digest

    def counting(*args):
        compared.append(1)
        return real(*args)

    monkeypatch.setattr(copy_check, "_written_digest", counting)
    model = _model()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 32)).sum().backward()
    opt.step()
    manager = ckpt.CheckpointManager(tmp_path / "c", async_save=True)
    hold = _HoldWrites()
    manager.observer = hold
    manager.save(ckpt.SaveRequest(step=1, model=model, optimizer=opt))
    before = model[0].weight.detach().clone()
    with torch.no_grad():
        model[0].weight.add_(1.0)  # the staged copy is a copy: this must not reach the file
    hold.release.set()
    info = manager.wait()
    # 4 parameters + 2 Adam moments each (the 0-d step counts are replicated tensors too)
    assert len(compared) >= 12
    loaded = _model()
    ckpt.load(info.path, model=loaded)
    assert torch.equal(loaded[0].weight, before)


@pytest.mark.compat
def test_digest_staged_hashes_the_bytes_torch_save_writes() -> None:
    import hashlib

    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    view = t[1:]  # does not span its storage: DCP clones it, so the digest is of the view's bytes
    digests = digest_staged({"a": t, "b": {"c": view}, "empty": torch.empty(0)})
    assert len(digests) == 2
    by_name = {d.name: d for d in digests.values()}
    assert by_name["a"].sha256 == hashlib.sha256(t.numpy().tobytes()).hexdigest()
    assert by_name["b.c"].sha256 == hashlib.sha256(view.contiguous().numpy().tobytes()).hexdigest()


def test_a_digest_belongs_to_the_tensor_it_names_when_views_share_a_start() -> None:
    import hashlib

    from shardline.checkpoint.integrity.copy_check import StagedDigester, tensor_key

    t = torch.arange(12, dtype=torch.float32)
    head = t[:4]  # starts where t starts: the same (device, data pointer) key
    digester = StagedDigester()
    digester.add(t)  # staged first, as a copy handed over during staging would be
    digests = digester.digests({"whole": t, "head": head})
    (entry,) = digests.values()
    assert tensor_key(head) == tensor_key(t)
    assert (entry.name, entry.nbytes) == ("head", 16)
    assert entry.sha256 == hashlib.sha256(head.numpy().tobytes()).hexdigest(), "the digest of the bytes it names"


@pytest.mark.compat
def test_async_staging_holds_one_reused_host_copy_and_resumes_bit_identically(tmp_path: Path) -> None:
    from shardline.testing import run_distributed
    from tests.checkpoint import ranks

    facts = run_distributed(ranks.async_host_staging, 2, args=(str(tmp_path / "c"),), timeout=120)
    for f in facts:
        # one copy of this rank's state (tied weights once), in host buffers that are not the model's storages
        assert f["buffers"] == f["tensors"] > 0
        assert f["pool_bytes"] == f["buffer_bytes"] == f["one_copy_bytes"] > 0
        assert f["buffers_outside_model"]
        assert f["all_on_host"]
        # the bytes hashed (and so written) are those buffers: no other staged copy exists
        assert f["hashed_are_buffers"]
        assert f["hashed_are_buffers_again"]
        # the engine's accounting of what the model holds does not move while the write is in flight
        assert f["memory_unchanged"]
        # the second save stages into the first one's buffers (kept alive, so equal pointers mean reuse)
        assert f["reused"]
        assert f["same_buffers"]
        assert f["freed_on_close"]
    assert facts[0]["resumed_identical"] is True


def test_host_buffers_are_reused_by_shape_and_dtype_and_trimmed() -> None:
    from shardline.checkpoint.lifecycle.host_buffers import HostBuffers

    pool = HostBuffers()
    a, b, c = torch.arange(6.0).reshape(2, 3), torch.ones(2, 3), torch.zeros(4, dtype=torch.int64)
    pool.begin()
    first = [pool.copy(t) for t in (a, b, c)]
    pool.finish()
    assert all(torch.equal(x, y) and x.data_ptr() != y.data_ptr() for x, y in zip(first, (a, b, c), strict=True))
    assert pool.nbytes == 6 * 4 * 2 + 4 * 8
    assert pool.source_device is None  # nothing came from an accelerator
    pool.begin()
    again = [pool.copy(t + 1) for t in (a, b)]  # same shapes, same order: the same buffers, new bytes
    assert [x is y for x, y in zip(again, first[:2], strict=True)] == [True, True]
    assert torch.equal(again[0], a + 1)
    odd = pool.copy(torch.zeros(3, 2))  # a new shape gets a new buffer
    assert all(odd.data_ptr() != x.data_ptr() for x in first)
    pool.finish()  # the int64 buffer went unused this round: freed
    assert pool.nbytes == 6 * 4 * 3
    pool.clear()
    assert pool.nbytes == 0
    assert pool.buffers == ()


def test_host_buffers_pin_only_for_cuda_sources() -> None:
    from types import SimpleNamespace

    from shardline.checkpoint.lifecycle.host_buffers import host_buffer_like, pins_for

    assert pins_for(SimpleNamespace(type="cuda", index=1))
    assert not pins_for(torch.device("cpu"))
    assert not pins_for(torch.device("meta"))
    source = torch.randn(3, 5, dtype=torch.bfloat16)
    buffer = host_buffer_like(source)
    assert (buffer.device.type, buffer.shape, buffer.dtype, buffer.is_pinned()) == (
        "cpu",
        source.shape,
        source.dtype,
        False,
    )
    assert buffer.is_contiguous()
    assert buffer.data_ptr() != source.data_ptr()


def test_the_writer_thread_binds_to_the_source_cuda_device_only() -> None:
    from types import SimpleNamespace

    from shardline.checkpoint.lifecycle.host_buffers import bind_writer_device

    calls: list[object] = []
    gpu1 = SimpleNamespace(type="cuda", index=1)
    assert bind_writer_device(gpu1, set_device=calls.append)
    assert calls == [gpu1]
    assert not bind_writer_device(torch.device("cpu"), set_device=calls.append)
    assert not bind_writer_device(None, set_device=calls.append)
    assert calls == [gpu1]
