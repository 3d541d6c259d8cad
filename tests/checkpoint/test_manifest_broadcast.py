"""At a load, the checked manifest reaches every rank as JSON, read by ``json.loads``, not by torch's unpickler."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from benchmarks.scale_capture import captured_checkpoint, rank_digests
from benchmarks.scale_layout import fake_sha256, state_dict_keys

from shardline.checkpoint.coordination import coord
from shardline.checkpoint.integrity.hashing import FileDigest
from shardline.checkpoint.integrity.manifest import DCP_METADATA, MANIFEST, MANIFEST_HASH_FILE
from shardline.checkpoint.integrity.opening import check_manifest
from shardline.checkpoint.integrity.verify import VerifyLevel
from shardline.checkpoint.lifecycle import load
from shardline.checkpoint.lifecycle.commit_records import build_records
from shardline.checkpoint.storage.stores import locate


def _checkpoint(root: Path, world: int) -> Path:
    """A checkpoint directory's manifest and hash file for ``world`` ranks x 8 data files (level ``none`` reads no
    more)."""
    tensors = state_dict_keys(layers=1)
    final = root / f"step-{world}"
    final.mkdir()
    captured = captured_checkpoint(final, world, tensors, 1)
    digests = [d for r in range(world) for d in rank_digests(tensors, world, r, 8)]
    made = build_records(captured, [*digests, FileDigest(DCP_METADATA, 0, 1000, fake_sha256(DCP_METADATA))])
    (final / MANIFEST).write_bytes(made.manifest)
    (final / MANIFEST_HASH_FILE).write_text(f"{made.manifest_sha256}  {MANIFEST}\n")
    return final


@pytest.mark.parametrize("world", [4, 256])
def test_every_rank_reads_the_checked_manifest_without_torchs_unpickler(
    world: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    unpickled: list[int] = []
    real_load = torch.load

    def counted_load(*args: Any, **kwargs: Any) -> Any:
        unpickled.append(1)
        return real_load(*args, **kwargs)

    real = coord.broadcast_object

    def over_the_wire(obj: Any, group: Any, **kwargs: Any) -> Any:
        return coord._decode(coord._encode(real(obj, group, **kwargs)))  # as a rank other than 0 gets it

    monkeypatch.setattr(coord, "broadcast_object", over_the_wire)
    monkeypatch.setattr(torch, "load", counted_load)
    final = _checkpoint(tmp_path, world)
    truth = check_manifest(final, level=VerifyLevel.NONE)
    for whole in (False, True):  # a load (rank 0 keeps what it checked), and the whole manifest
        checked = load._checked(locate(final), VerifyLevel.NONE, None, None, whole=whole)
        assert len(checked.entries()) == world * 8 + 1
        assert checked.entries() == truth.entries()
        assert checked.manifest_hash == truth.manifest_hash
        if whole:
            assert checked.manifest == truth.manifest
    assert unpickled == []  # before: one torch.load, unpickling five objects per listed file in Python


@pytest.mark.parametrize(
    "message",
    [
        {"value": {"a": [1, 2.5, "x", None, True]}},
        {"value": (1, 2)},  # a tuple: JSON would give a list
        {"value": {1: "one"}},  # an int key: JSON would give a string
        {"value": float("nan")},
        {"value": b"bytes"},
        {"value": torch.arange(3)},
    ],
)
def test_a_message_comes_back_as_it_was_sent(message: dict[str, Any]) -> None:
    back = coord._decode(coord._encode(message))
    if isinstance(message["value"], torch.Tensor):
        assert torch.equal(back["value"], message["value"])
    elif message["value"] != message["value"]:  # NaN
        assert back["value"] != back["value"]
    else:
        assert back == message
        assert type(back["value"]) is type(message["value"])
