"""The offline corpus is deterministic; batches split across ranks exactly like one big batch."""

from __future__ import annotations

import pytest
import torch

from shardline.errors import ConfigurationError
from shardline.train.data import Batches, build_stdlib_corpus


def test_corpus_is_deterministic_and_split_by_file() -> None:
    a = build_stdlib_corpus(max_bytes=300_000)
    b = build_stdlib_corpus(max_bytes=300_000)
    assert a.fingerprint == b.fingerprint
    assert torch.equal(a.train, b.train)
    assert torch.equal(a.val, b.val)
    assert a.train.numel() >= 300_000
    assert a.files_val >= 1
    assert a.train.dtype == torch.uint8
    assert build_stdlib_corpus(max_bytes=1_000_000).fingerprint != a.fingerprint, "the fingerprint covers the content"


def test_corpus_from_a_directory(tmp_path) -> None:
    for i in range(40):
        (tmp_path / f"m{i:02d}.py").write_text(f"x = {i}\n" * 200)
    corpus = build_stdlib_corpus(max_bytes=2000, root=tmp_path)
    assert corpus.files_train + corpus.files_val <= 40
    with pytest.raises(ConfigurationError, match="no usable Python sources"):
        build_stdlib_corpus(max_bytes=2000, root=tmp_path / "missing")


def test_rank_batches_are_slices_of_the_global_batch() -> None:
    data = torch.arange(10_000) % 256
    whole = Batches(data, seq_len=16, global_batch=12, rank=0, world_size=1, seed=7)
    for world in (2, 3, 4):
        parts = [Batches(data, seq_len=16, global_batch=12, rank=r, world_size=world, seed=7) for r in range(world)]
        for step in (0, 5):
            x, y = whole.local(step)
            xs, ys = zip(*(p.local(step) for p in parts), strict=True)
            assert torch.equal(torch.cat(xs), x)
            assert torch.equal(torch.cat(ys), y)
            assert torch.equal(x[:, 1:], y[:, :-1]), "targets are inputs shifted by one"
    assert not torch.equal(whole.local(0)[0], whole.local(1)[0])
    with pytest.raises(ConfigurationError, match=r"global batch \(12\) must be divisible by the number of ranks \(5\)"):
        Batches(data, seq_len=16, global_batch=12, rank=0, world_size=5, seed=7)
