"""torch.save's small writes are gathered before they reach the hashing stream; the files and digests are unchanged."""

from __future__ import annotations

import collections
from pathlib import Path

import torch
from torch import nn

import shardline.checkpoint as ckpt
from shardline.checkpoint.integrity import hashing


def _model(layers: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(layers)])  # unwrapped: one process, no group
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, 256)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_a_save_hands_the_hashing_stream_a_few_writes_per_tensor_not_forty(tmp_path: Path, monkeypatch) -> None:
    model, optimizer = _model(8)
    tensors = len(ckpt.model_state_dict(model)) + 3 * len(list(model.parameters()))  # Adam: step, exp_avg(_sq)
    calls: collections.Counter[int] = collections.Counter()
    nbytes: collections.Counter[int] = collections.Counter()
    real = hashing._HashingStream.write

    def spy(self: hashing._HashingStream, data: object) -> int:
        calls[id(self)] += 1
        n = real(self, data)  # type: ignore[arg-type]
        nbytes[id(self)] += n
        return n

    monkeypatch.setattr(hashing._HashingStream, "write", spy)
    ckpt.save(tmp_path / "step-1", model=model, optimizer=optimizer, step=1, files_per_rank=2)
    assert (
        sum(nbytes.values())
        == sum(f.stat().st_size for f in (tmp_path / "step-1").glob("*.distcp"))
        + (tmp_path / "step-1" / ".metadata").stat().st_size
    )
    # torch.save writes about forty small buffers per tensor; gathered, each 256 KiB storage arrives alone, with a
    # block of the small writes before it.
    assert sum(calls.values()) <= 3 * tensors, (sum(calls.values()), tensors)
    assert ckpt.verify_checkpoint(tmp_path / "step-1").ok, "every file matches the digest hashed while it was written"


def test_what_is_gathered_reaches_the_file_before_an_fsync_through_fileno(tmp_path: Path) -> None:
    """DCP fsyncs a file through ``fileno()`` without flushing it first: nothing may stay gathered in memory."""
    import os

    fs = hashing.HashingFileSystem()
    target = tmp_path / ".metadata"
    with fs.create_stream(target, "wb") as stream:
        stream.write(b"pickled metadata" * 10)  # small: gathered, not yet in the file
        fd = stream.fileno()
        assert os.fstat(fd).st_size == 160, "the fsync would miss bytes still gathered in memory"
    assert target.stat().st_size == 160
