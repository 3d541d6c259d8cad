"""At a load, the checked manifest reaches every rank as the bytes rank 0 checked, not as 131k unpickled dicts."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from benchmarks import scale_sim
from benchmarks.scale_layout import fake_sha256, state_dict_keys

from shardline.checkpoint.coordination import coord
from shardline.checkpoint.integrity.hashing import FileDigest
from shardline.checkpoint.integrity.manifest import DCP_METADATA, MANIFEST, MANIFEST_HASH_FILE
from shardline.checkpoint.integrity.opening import CheckedManifest, check_manifest
from shardline.checkpoint.integrity.verify import VerifyLevel
from shardline.checkpoint.lifecycle import load
from shardline.checkpoint.lifecycle.commit_records import build_records
from shardline.checkpoint.storage.stores import locate
from shardline.errors import IntegrityError


def _checkpoint(root: Path, world: int) -> Path:
    """A checkpoint directory's manifest and hash file for ``world`` ranks x 8 data files (level ``none`` reads no
    more)."""
    tensors = state_dict_keys(layers=1)
    final = root / f"step-{world}"
    final.mkdir()
    captured = scale_sim.captured_checkpoint(final, world, tensors, 1)
    digests = [d for r in range(world) for d in scale_sim.rank_digests(tensors, world, r, 8)]
    made = build_records(captured, [*digests, FileDigest(DCP_METADATA, 0, 1000, fake_sha256(DCP_METADATA))])
    (final / MANIFEST).write_bytes(made.manifest)
    (final / MANIFEST_HASH_FILE).write_text(f"{made.manifest_sha256}  {MANIFEST}\n")
    return final


def _objects(value: Any) -> Iterator[Any]:
    """Every container and scalar in ``value`` (what an unpickler builds one by one)."""
    yield value
    if isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield from _objects(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _objects(v)


@pytest.mark.parametrize("world", [4, 256])
def test_every_rank_receives_the_checked_bytes_not_one_object_per_file(
    world: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: list[int] = []
    real = coord.broadcast_object

    def over_the_wire(obj: Any, group: Any, **kwargs: Any) -> Any:
        received = coord._decode(coord._encode(real(obj, group, **kwargs)))  # as a rank other than 0 gets it
        sent.append(sum(1 for _ in _objects(received)))
        return received

    monkeypatch.setattr(coord, "broadcast_object", over_the_wire)
    final = _checkpoint(tmp_path, world)
    checked = load._checked(locate(final), VerifyLevel.NONE, None, None)
    assert len(checked.entries()) == world * 8 + 1
    assert checked.manifest == check_manifest(final, level=VerifyLevel.NONE).manifest
    # a handful of objects at any world size (before: five per listed file, 5,000+ at 256 ranks)
    assert len(sent) == 1, sent
    assert sent[0] < 20, sent


def test_bytes_that_do_not_hash_to_the_checked_manifest_are_refused(tmp_path: Path) -> None:
    final = _checkpoint(tmp_path, 2)
    data = check_manifest(final, level=VerifyLevel.NONE).to_json()
    data["manifest_json"] = data["manifest_json"].replace(b'"rank":1', b'"rank":0')
    with pytest.raises(IntegrityError, match=r"received sha256 .* rank 0 checked"):
        CheckedManifest.from_json(data)
