"""Rank 0's commit records at many ranks: the file list built and encoded once, the statement naming the manifest,
the digests gathered as compact records, and the canonical-JSON check that stays exact on its fast path."""

from __future__ import annotations

import enum
import hashlib
import json
import pickle
from pathlib import Path
from typing import Any

import pytest
from benchmarks.scale_capture import captured_checkpoint, rank_digests
from benchmarks.scale_layout import state_dict_keys
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from shardline.checkpoint.format.canonical import canonical_json
from shardline.checkpoint.integrity.hashing import FileDigest
from shardline.checkpoint.integrity.hashing_writer import digest_result, split_digests
from shardline.checkpoint.lifecycle.commit_records import CommitRecords, build_records
from shardline.checkpoint.provenance.statement import STATEMENT_FILE, statement_problems
from shardline.errors import ConfigurationError


def _records(world: int, tmp_path: Path) -> tuple[CommitRecords, list[FileDigest]]:
    tensors = state_dict_keys(layers=1)
    digests = [d for r in range(world) for d in rank_digests(tensors, world, r, 8)]
    return build_records(captured_checkpoint(tmp_path / "step-1", world, tensors, 1), digests), digests


def test_the_statement_names_the_manifest_and_stays_the_same_size_at_any_world(tmp_path: Path) -> None:
    small, _ = _records(8, tmp_path)
    large, digests = _records(512, tmp_path)
    statement = json.loads(large.statement)
    assert statement["subject"] == [{"name": "manifest.json", "digest": {"sha256": large.manifest_sha256}}]
    assert large.manifest_sha256 == hashlib.sha256(large.manifest).hexdigest()
    assert large.statement_sha256 == hashlib.sha256(large.statement).hexdigest()
    # 64x the files: the manifest grows with them, the statement does not (it listed every file before)
    assert len(large.manifest) > 40 * len(small.manifest) // 8
    assert abs(len(large.statement) - len(small.statement)) < 16
    manifest = json.loads(large.manifest)
    assert [f["path"] for f in manifest["files"]] == sorted(d.path for d in digests)
    assert statement_problems(statement, manifest, manifest_sha256=large.manifest_sha256) == []
    # SHA256SUMS: every listed file, the manifest and the statement, each once
    sums = dict(reversed(line.split("  ")) for line in large.sums.decode().splitlines())
    assert sums == {
        **{d.path: d.sha256 for d in digests},
        "manifest.json": large.manifest_sha256,
        STATEMENT_FILE: large.statement_sha256,
    }
    # what every rank learns counts the statement with the data files (as before)
    assert len(large.files) == len(digests) + 1


def test_digests_are_gathered_as_compact_records_and_the_dict_form_still_reads() -> None:
    records = [FileDigest(path=f"__{r}_0.distcp", rank=r, bytes=100 + r, sha256=f"{r:064x}") for r in range(3)]
    results = [[digest_result(d)] for d in records]
    assert type(results[0][0].storage_data) is tuple
    # the dict {path, rank, bytes, sha256} earlier writers sent: bigger in DCP's gather, still read
    older = [
        [WriteResult(r.index, r.size_in_bytes, d.to_json()) for r in rs] for rs, d in zip(results, records, strict=True)
    ]
    assert len(pickle.dumps(results)) < len(pickle.dumps(older))
    _, found = split_digests(results)
    assert list(found.values()) == records
    assert split_digests(older)[1] == found


class _Level(enum.IntEnum):
    HIGH = 2


def test_the_fast_canonical_check_keeps_the_rules_and_the_messages() -> None:
    files = [{"path": "a", "rank": 0, "bytes": 1, "sha256": "x"}, {"path": "b", "rank": 1, "bytes": 2.0, "sha": "y"}]
    with pytest.raises(ConfigurationError, match=r"found 2\.0 at files\[1\]\.bytes"):
        canonical_json({"files": files})
    with pytest.raises(ConfigurationError, match="string keys"):
        canonical_json({"files": [{1: "a"}]})
    with pytest.raises(ConfigurationError, match=r"at x\[0\]\[1\]"):
        canonical_json({"x": [[1, 0.5]]})
    with pytest.raises(ConfigurationError, match="found set"):
        canonical_json({"x": [{"y": {1, 2}}]})
    # what the generic check accepted, the fast path still accepts: tuples, int subclasses, booleans, None
    assert (
        canonical_json({"t": (1, "a"), "e": _Level.HIGH, "b": [True, None]}) == b'{"b":[true,null],"e":2,"t":[1,"a"]}'
    )


class _CountedResult:
    """A gathered write result that counts how often rank 0 looks at its index."""

    looked = 0

    def __init__(self, result: WriteResult) -> None:
        self._result = result

    @property
    def index(self) -> Any:
        _CountedResult.looked += 1
        return self._result.index

    @property
    def storage_data(self) -> Any:
        return self._result.storage_data


def test_rank_0_takes_the_digests_from_each_list_end_without_looking_at_dcps_results() -> None:
    world, items, files = 4, 5000, 8
    dcp_results = [
        [WriteResult(MetadataIndex(f"model.w{i}", [r * 10]), 40, ("file", r, i)) for i in range(items)]
        for r in range(world)
    ]
    records = [
        FileDigest(path=f"__{r}_{n}.distcp", rank=r, bytes=n, sha256=f"{r * files + n:064x}")
        for r in range(world)
        for n in range(files)
    ]
    gathered = [
        [_CountedResult(w) for w in dcp_results[r]] + [_CountedResult(digest_result(d)) for d in records[r::world]]
        for r in range(world)
    ]
    _CountedResult.looked = 0
    clean, found = split_digests(gathered)  # type: ignore[arg-type]
    # each rank's digest records and the one DCP result before them: not the 5,000 DCP results
    assert _CountedResult.looked == world * (files + 1), _CountedResult.looked
    assert sorted(found.values()) == sorted(records)
    assert [[c._result for c in rank] for rank in clean] == dcp_results  # DCP's results, all and in order
