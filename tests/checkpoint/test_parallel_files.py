"""Several files per rank: each hashed by its writer thread, verified on several threads, resharded, exported."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import shardline.checkpoint as ckpt
from shardline.checkpoint.coordination.parallelism import files_for_share, resolve_files_per_rank
from shardline.checkpoint.integrity import verify as verify_module
from shardline.checkpoint.integrity.manifest import read_manifest
from shardline.errors import ConfigurationError
from shardline.testing import run_distributed
from tests.checkpoint import ranks
from tests.checkpoint.test_reshard import _assert_equal


@pytest.mark.parametrize(
    ("cores", "local_ranks", "expected"),
    [(16, "4", 4), (16, "1", 8), (2, "4", 1), (3, "2", 1), (6, None, 6)],
)
def test_automatic_count_is_the_cores_each_rank_has(monkeypatch, cores, local_ranks, expected) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(cores)), raising=False)
    if local_ranks is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)  # one process, no process group: all cores
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local_ranks)
    assert resolve_files_per_rank(0) == expected
    assert resolve_files_per_rank(3) == 3  # an explicit count is taken as given


def test_automatic_count_gives_each_file_16_mib_or_more(monkeypatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(16)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    mib = 1 << 20
    assert files_for_share(0, share_bytes=100 * mib, items=50) == 6  # 100 MiB // 16 MiB, under 8 cores
    assert files_for_share(0, share_bytes=1000 * mib, items=50) == 8  # the ceiling
    assert files_for_share(0, share_bytes=1000 * mib, items=3) == 3  # never more files than items
    assert files_for_share(0, share_bytes=4096, items=50) == 1  # a small share stays one file
    assert files_for_share(3, share_bytes=4096, items=50) == 3  # an explicit count is taken as given
    assert files_for_share(3, share_bytes=4096, items=2) == 2
    assert files_for_share(3, share_bytes=0, items=0) == 1


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_a_bad_count_is_one_line_naming_it(bad) -> None:
    with pytest.raises(ConfigurationError, match=rf"^files_per_rank={bad!r} is not a file count; use a positive"):
        resolve_files_per_rank(bad)


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_three_files_per_rank_reshard_verify_and_export(tmp_path: Path) -> None:
    path = tmp_path / "step-2"
    saved = run_distributed(
        ranks.save_trained,
        2,
        args=(str(path), "full_shard", False, "sharded"),
        kwargs={"files_per_rank": 3},
        timeout=60,
    )
    expected = ranks.unpack(saved[0][1])
    manifest, digest = read_manifest(path)
    assert digest == saved[0][0] == saved[1][0]
    shards = {f["path"]: f["rank"] for f in manifest["files"] if f["path"].endswith(".distcp")}
    assert shards == {f"__{r}_{n}.distcp": r for r in (0, 1) for n in range(3)}
    assert all(f["bytes"] > 0 for f in manifest["files"])  # the items are spread over the files, none is empty
    sums = subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=path, capture_output=True, text=True)
    assert sums.returncode == 0, sums.stdout + sums.stderr
    assert sums.stdout.count(": OK") == 9  # .metadata, six shard files, the statement, manifest.json
    assert ckpt.verify_checkpoint(path).ok

    damaged = tmp_path / "damaged" / "step-2"
    shutil.copytree(path, damaged)
    _flip(damaged / "__1_2.distcp")
    report = ckpt.verify_checkpoint(damaged)
    assert [(p.path, p.kind) for p in report.problems] == [("__1_2.distcp", "altered")]

    # one rank reads and hashes all six files (on several threads where it has the cores)
    (taken, (kind, message)) = run_distributed(
        ranks.load_good_and_damaged, 1, args=(str(path), str(damaged)), timeout=60
    )[0]
    _assert_equal(expected, ranks.unpack(taken))
    assert kind == "IntegrityError", message
    assert "__1_2.distcp: altered (sha256" in message, message
    loaded = run_distributed(ranks.load_into, 3, args=(str(path), "full_shard", "full"), timeout=60)
    _assert_equal(expected, ranks.unpack(loaded[0][1]))

    result = ckpt.consolidate(path, tmp_path / "model.safetensors")
    exported = load_file(result.out)
    full, _ = expected
    for key, value in exported.items():
        assert torch.equal(value, full[key].reshape(value.shape)), key
    assert set(exported) <= set(full)


def test_async_saves_with_several_files_check_every_file_against_the_staged_bytes(tmp_path: Path) -> None:
    # the staged-bytes check reads each tensor back from whichever of the rank's files holds it
    directory = tmp_path / "checkpoints"
    run_distributed(ranks.run_with_manager, 1, args=(str(directory), 4, [2, 4], True, 3), timeout=60)
    for step in ("step-2", "step-4"):
        manifest, _ = read_manifest(directory / step)
        assert sorted(f["path"] for f in manifest["files"] if f["path"].endswith(".distcp")) == [
            "__0_0.distcp",
            "__0_1.distcp",
            "__0_2.distcp",
        ]
        assert ckpt.verify_checkpoint(directory / step).ok
    assert read_manifest(directory / "step-4")[0]["parent_manifest_sha256"] == read_manifest(directory / "step-2")[1]


def test_offline_check_hashes_large_files_on_threads_and_reports_in_order(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(verify_module, "available_cores", lambda: 4)
    seen_threads: set[str] = set()
    plain = verify_module.sha256_file

    def spy(path: Path) -> tuple[int, str]:
        seen_threads.add(threading.current_thread().name)
        return plain(path)

    monkeypatch.setattr(verify_module, "sha256_file", spy)
    entries = []
    for n in range(4):  # 4 x 6 MiB: over the 16 MiB below which one thread does it all
        data = bytes([n]) * (6 << 20)
        (tmp_path / f"__0_{n}.distcp").write_bytes(data)
        entries.append({"path": f"__0_{n}.distcp", "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    _flip(tmp_path / "__0_3.distcp")
    _flip(tmp_path / "__0_1.distcp")
    problems, read = verify_module.check_files(tmp_path, entries, "full")
    assert [(p.path, p.kind) for p in problems] == [("__0_1.distcp", "altered"), ("__0_3.distcp", "altered")]
    assert read == 4 * (6 << 20)
    assert all(name.startswith("shardline-verify") for name in seen_threads), seen_threads
