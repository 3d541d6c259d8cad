"""A bucket save spreads its data files over key prefixes (``shards/GGGG/``, ``key_prefixes.py``); everything that
reads, checks, downloads or clears a bucket checkpoint follows. Against the session SeaweedFS server."""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path

import pytest

import shardline.checkpoint as ckpt
from shardline.checkpoint.faults.crashpoints import CRASH_EXIT_CODE
from shardline.checkpoint.storage.key_prefixes import RANKS_PER_PREFIX, max_objects_per_prefix, rank_of, spread_prefix
from shardline.testing import run_distributed
from tests.checkpoint import object_crashes, object_ranks, ranks
from tests.checkpoint.conftest import S3_BUCKET
from tests.checkpoint.seaweed import S3Server
from tests.checkpoint.test_reshard import _assert_equal

pytestmark = pytest.mark.timeout(180)


def _prefix() -> str:
    return f"s3://{S3_BUCKET}/{uuid.uuid4().hex[:12]}"


def test_the_layout_bounds_the_objects_under_one_prefix() -> None:
    """At 16,384 ranks x 8 files, no key prefix holds more than 2,048 data files (a flat save: 131,072)."""
    assert max_objects_per_prefix(world=16_384, files_per_rank=8, spread=True) == 2_048
    assert max_objects_per_prefix(world=16_384, files_per_rank=8, spread=False) == 131_072
    folders: dict[str, int] = {}
    for rank in range(16_384):
        folder = spread_prefix(rank).rsplit("/", 1)[0]
        folders[folder] = folders.get(folder, 0) + 8
        assert rank_of(f"{spread_prefix(rank)}7.distcp") == rank
    assert len(folders) == 16_384 // RANKS_PER_PREFIX == 64
    assert max(folders.values()) == 2_048
    assert spread_prefix(0) == "shards/0000/__0_"
    assert spread_prefix(16_383) == "shards/0063/__16383_"
    assert rank_of("__12_3.distcp") == 12
    assert rank_of(".metadata") is None


def test_a_bucket_save_spreads_its_data_files_and_everything_follows(s3_env: S3Server, tmp_path: Path) -> None:
    """W=2 saves into the bucket: every data file is under ``shards/0000/`` (none beside the manifest), the manifest
    and ``.metadata`` name them there, with the rank that wrote each; the checkpoint verifies, loads the saved state at
    W=1 and W=2, and a downloaded copy passes ``sha256sum -c SHA256SUMS``. A local save of the same stays flat."""
    url = f"{_prefix()}/step-2"
    digest, expected = run_distributed(
        ranks.save_trained, 2, args=(url, "full_shard", False, "sharded", 2), timeout=120, env=s3_env.env
    )[0]
    fs, key = s3_env.filesystem(), url.removeprefix("s3://")
    keys = sorted(str(k)[len(key) + 1 :] for k in fs.find(key))
    data = [k for k in keys if k.endswith(".distcp")]
    assert data == [f"shards/0000/__{r}_{n}.distcp" for r in range(2) for n in range(2)], keys
    assert not [k for k in keys if "/" in k and not k.startswith("shards/0000/")], keys
    manifest = json.loads(fs.cat_file(f"{key}/manifest.json"))
    listed = {f["path"]: f["rank"] for f in manifest["files"] if f["path"].endswith(".distcp")}
    assert listed == {p: rank_of(p) for p in data}
    report = ckpt.verify_checkpoint(url)
    assert report.ok, report.to_json()
    assert report.manifest_hash == digest
    for world in (1, 2):
        step, state = run_distributed(object_ranks.load_step, world, args=(url,), timeout=120, env=s3_env.env)[0]
        assert step == 2
        _assert_equal(ranks.unpack(expected), ranks.unpack(state))

    copy = tmp_path / "download"
    fs.get(key + "/", str(copy), recursive=True)  # what `aws s3 cp --recursive` gives
    assert (copy / "shards" / "0000" / "__1_1.distcp").is_file()
    check = subprocess.run(["sha256sum", "-c", "--strict", "SHA256SUMS"], cwd=copy, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "shards/0000/__0_0.distcp: OK" in check.stdout
    assert ckpt.verify_checkpoint(copy).ok, "the downloaded copy verifies as a local checkpoint"

    local = tmp_path / "local" / "step-2"
    run_distributed(ranks.save_trained, 1, args=(str(local), "full_shard", False, "sharded", 2), timeout=120)
    assert sorted(p.name for p in local.glob("*.distcp")) == ["__0_0.distcp", "__0_1.distcp"]
    assert not (local / "shards").exists()


def test_an_uncommitted_bucket_save_is_cleared_with_its_nested_objects(s3_env: S3Server, tmp_path: Path) -> None:
    """A save of step 2 dies after its uploads, before its manifest: its data files are under ``step-2/shards/``.
    The next manager's open clears the prefix -- every nested object -- and step 2 saves again."""
    root, ledger = _prefix(), str(tmp_path / "lineage.sqlite")
    code = object_crashes.run_killed_save(root, ledger, s3_env.env, [1, 2], "save.sums_written")
    assert code == CRASH_EXIT_CODE
    fs, key = s3_env.filesystem(), root.removeprefix("s3://")
    left = sorted(str(k)[len(key) + 1 :] for k in fs.find(f"{key}/step-2"))
    assert any(k.startswith("step-2/shards/0000/") and k.endswith(".distcp") for k in left), left
    assert "step-2/manifest.json" not in left
    m = object_crashes.manager(root, ledger, s3_env.env)
    assert fs.find(f"{key}/step-2") == [], "every object of the uncommitted save, nested ones too, is deleted"
    assert object_crashes.leftovers(root) == []
    model, opt = object_crashes.sc._model()
    object_crashes.sc._save(m, model, opt, 2)
    assert ckpt.verify_checkpoint(f"{root}/step-2").ok


def test_a_flat_bucket_checkpoint_from_before_still_verifies_and_loads(s3_env: S3Server) -> None:
    """The committed format fixture, uploaded as a bucket held it before the layout (``__R_N.distcp`` beside the
    manifest), verifies in full and loads at W=2 to the values its writers held."""
    from tests.checkpoint import format_fixture as fx
    from tests.checkpoint.test_format_fixture import MANIFEST_SHA256, _assert_equal, _expected, load_direct

    url = f"{_prefix()}/step-2"
    fs, key = s3_env.filesystem(), url.removeprefix("s3://")
    for file in sorted((fx.FIXTURE / "step-2").iterdir()):
        fs.put_file(str(file), f"{key}/{file.name}")
    assert [k for k in fs.find(key) if k.endswith(".distcp")] == [f"{key}/__0_0.distcp", f"{key}/__1_0.distcp"]
    report = ckpt.verify_checkpoint(url, expected_manifest_hash=MANIFEST_SHA256)
    assert report.ok, report.to_json()
    assert report.files_checked == 7
    results = run_distributed(load_direct, 2, args=(url,), timeout=120, env=s3_env.env)
    _assert_equal(ranks.unpack(results[0][0]), _expected())
    assert results[1][1] == fx.TRAINER_STATE


def test_the_dcp_native_writer_spreads_a_bucket_save_too(s3_env: S3Server, tmp_path: Path) -> None:
    """``dcp.save(state, storage_writer=Writer(url))`` at W=2 puts its data files under ``shards/0000/``, the
    checkpoint verifies, and ``Reader`` loads each rank's tensor back."""
    url = f"{_prefix()}/step-1"
    loaded = run_distributed(
        object_ranks.writer_saves, 2, args=(url, str(tmp_path / "lineage.sqlite")), timeout=120, env=s3_env.env
    )
    assert loaded == [{"rank0": 64.0}, {"rank1": 128.0}]
    fs, key = s3_env.filesystem(), url.removeprefix("s3://")
    data = sorted(str(k)[len(key) + 1 :] for k in fs.find(key) if str(k).endswith(".distcp"))
    assert data == ["shards/0000/__0_0.distcp", "shards/0000/__1_0.distcp"]
    assert ckpt.verify_checkpoint(url).ok
