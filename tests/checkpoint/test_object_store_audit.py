"""Auditing a run whose checkpoints are in a bucket: ``shardline lineage`` and ``shardline report`` against the
session SeaweedFS server.

One manager run (one worker, two checkpoints in a fresh prefix, the ledger in a local run directory)
serves every check: the clean run verifies, with what was listed in the bucket named; a flipped
byte is named by the report; checkpoints saved into the prefix outside the run are named by
``lineage``; an unreachable endpoint is one line and exit 2.
"""

from __future__ import annotations

import json
import shutil
import socket
import sqlite3
import uuid
from pathlib import Path

import pytest

from shardline import cli
from shardline.checkpoint.provenance.ledger import Ledger
from shardline.report import collect_run
from shardline.testing import run_distributed
from tests.checkpoint import object_ranks
from tests.checkpoint.conftest import S3_BUCKET
from tests.checkpoint.seaweed import S3Server

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def s3_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """The server's endpoint and credentials in this process's AWS environment (the ranks get them too)."""
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    return s3_server


@pytest.fixture(scope="module")
def bucket_run(s3_server: S3Server, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """``(run_dir, prefix)``: step-1 and step-2 saved by a manager into ``prefix``, the ledger in ``run_dir``."""
    run_dir = tmp_path_factory.mktemp("bucket-run")
    root = f"s3://{S3_BUCKET}/audit-{uuid.uuid4().hex[:12]}"
    args = (root, str(run_dir / "lineage.sqlite"), [1, 2])
    run_distributed(object_ranks.manager_saves, 1, args=args, timeout=90, env=s3_server.env)
    return run_dir, root


def _flip(fs, key: str) -> bytes:
    """Flip one bit in the middle of the object ``key``; its original bytes."""
    data = fs.cat_file(key)
    changed = bytearray(data)
    changed[len(changed) // 2] ^= 0x01
    fs.pipe_file(key, bytes(changed))
    return data


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_lineage_lists_the_bucket_for_checkpoints_the_chain_lacks(
    bucket_run: tuple[Path, str], s3_env: S3Server, capsys: pytest.CaptureFixture
) -> None:
    run_dir, root = bucket_run
    # The clean run: exit 0, and the success line says which bucket prefix was listed.
    assert cli.main(["lineage", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert f"and the bucket prefix {root}/ (endpoint {s3_env.endpoint}) is in the chain." in out
    assert "on disk and in the object store matches its recorded manifest hash" in out
    assert cli.main(["lineage", "--json", str(run_dir)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"]
    assert [c["location"] for c in report["checked"] if c["store"]] == [root]
    assert [r["checkpoint"] for r in report["rows"] if r["event"] in (None, "commit")] == [
        f"{root}/step-1",
        f"{root}/step-2",
    ]
    assert all(r["provenance"]["matches_ledger"] for r in report["rows"] if r["event"] in (None, "commit"))

    # Checkpoints saved outside the run with the library's save (no ledger): one into the run's prefix, one into
    # another prefix that only the run's recorded config names.
    other = f"{root}-other"
    paths = [f"{root}/step-7", f"{other}/step-9"]
    strays = run_distributed(object_ranks.save_strays, 1, args=(paths,), timeout=90, env=s3_env.env)[0]
    # One alone reads as a save interrupted after its commit, exactly as on disk: a note naming it, exit 0.
    assert cli.main(["lineage", str(run_dir)]) == 0
    note = f"note: {root}/step-7 (step 7, manifest {strays[0][:12]}) is committed but not yet in the ledger"
    assert note in capsys.readouterr().out
    # The other prefix named on the command line (with the run's ledger): two unrecorded, exit 1 naming both.
    assert cli.main(["lineage", other, "--ledger", str(run_dir / "lineage.sqlite")]) == 1
    err = capsys.readouterr().err
    for path, digest in zip(paths, strays, strict=True):
        step = path.rsplit("-", 1)[1]
        assert f"{path} (step {step}, manifest {digest[:12]}) is committed in the object store but missing from " in err
    assert cli.main(["lineage", other]) == 2
    assert "--ledger RUN_DIR/lineage.sqlite" in capsys.readouterr().err
    # ... or recorded as checkpoint.dir in the run's config.yaml: listed too.
    (run_dir / "config.yaml").write_text(f"checkpoint:\n  dir: {other}\n")
    try:
        assert cli.main(["lineage", str(run_dir)]) == 1
        assert f"{other}/step-9 (step 9," in capsys.readouterr().err
    finally:
        (run_dir / "config.yaml").unlink()
        s3_env.filesystem().rm(f"{root.removeprefix('s3://')}/step-7", recursive=True)


def test_new_chain_records_the_checkpoints_in_the_bucket(
    bucket_run: tuple[Path, str], s3_env: S3Server, capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    """An edited ledger of a bucket run: ``--new-chain`` records the bucket's checkpoints again, by URL."""
    run_dir, root = bucket_run
    for name in ("lineage.sqlite", "lineage.sqlite.head"):
        shutil.copy(run_dir / name, tmp_path / name)
    conn = sqlite3.connect(tmp_path / "lineage.sqlite")
    conn.execute("DROP TRIGGER checkpoints_no_update")
    conn.execute("UPDATE checkpoints SET step = 5 WHERE seq = 1")
    conn.commit()
    conn.close()
    assert cli.main(["lineage", str(tmp_path)]) == 1
    capsys.readouterr()
    assert cli.main(["lineage", str(tmp_path), "--new-chain"]) == 0
    assert (
        "then 2 committed checkpoint(s) on disk and in the object store are recorded again" in capsys.readouterr().out
    )
    rows = [r for r in Ledger(tmp_path / "lineage.sqlite").rows() if r.is_commit]
    assert [(r.checkpoint, r.recovered) for r in rows] == [(f"{root}/step-1", True), (f"{root}/step-2", True)]
    assert cli.main(["lineage", str(tmp_path)]) == 0


def test_verify_inspect_and_consolidate_take_urls(
    bucket_run: tuple[Path, str],
    s3_env: S3Server,
    capsys: pytest.CaptureFixture,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the other object-store tests leave out: sizes-only and pinned verification, the plain-words summary,
    a directory export, and a URL given as the export's output."""
    run_dir, root = bucket_run
    url = f"{root}/step-2"
    digest = collect_run(run_dir).checkpoints[-1].row.manifest_sha256
    assert cli.main(["verify", "--level", "sizes", url]) == 0
    assert f"OK: {url} (step 2): 6 files match the manifest (sizes only)" in capsys.readouterr().out
    assert cli.main(["verify", "--expect", digest, url]) == 0
    assert cli.main(["verify", "--expect", "0" * 64, url]) == 1
    assert f"manifest hash {digest} differs from the expected" in capsys.readouterr().err
    assert cli.main(["inspect", url]) == 0
    assert "inside the directory (a copy of it: the files are in an object store)" in capsys.readouterr().out
    assert cli.main(["inspect", f"{root}/step-5"]) == 1
    assert f"{root}/step-5 is not a checkpoint: no object under that prefix" in capsys.readouterr().err

    out = tmp_path / "export"
    assert cli.main(["consolidate", url, str(out), "--max-shard-size", "20KB"]) == 0
    assert json.loads((out / "consolidation.json").read_text())["source"]["checkpoint"] == url
    assert cli.main(["verify", str(out)]) == 0
    # An output URL would have been a local directory named "s3:": refused, exit 2, nothing written.
    monkeypatch.chdir(tmp_path)
    assert cli.main(["consolidate", url, f"{root}/export"]) == 2
    assert "write it to a local path, then upload it" in capsys.readouterr().err
    assert not (tmp_path / "s3:").exists()


def test_report_verifies_every_checkpoint_in_the_bucket(
    bucket_run: tuple[Path, str], s3_env: S3Server, capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    run_dir, root = bucket_run
    out = tmp_path / "report.html"
    assert cli.main(["report", str(run_dir), "--out", str(out)]) == 0, capsys.readouterr()
    assert "2 checkpoint(s), 2 verified" in capsys.readouterr().out
    facts = collect_run(run_dir)
    assert [(str(c.path), c.status) for c in facts.checkpoints] == [
        (f"{root}/step-1", "verified"),
        (f"{root}/step-2", "verified"),
    ]
    for c in facts.checkpoints:  # the statement was read from the bucket and matches the ledger's record
        assert (c.statement_source, c.statement_matches_ledger) == ("checkpoint", True)
        assert c.statement["predicate"]["checkpoint"]["step"] == c.row.step
    page = out.read_text()
    assert f"shardline verify {root}/step-2 --expect {facts.checkpoints[1].row.manifest_sha256}" in page

    # A flipped byte in one object: the report says which checkpoint failed and names the object.
    fs = s3_env.filesystem()
    key = f"{root.removeprefix('s3://')}/step-1/shards/0000/__0_0.distcp"
    original = _flip(fs, key)
    try:
        assert cli.main(["report", str(run_dir), "--out", str(out)]) == 1
        assert "NOT verified: step-1" in capsys.readouterr().out
        failed = collect_run(run_dir).checkpoints[0]
        assert failed.status == "failed"
        assert any(p.startswith("shards/0000/__0_0.distcp: altered") for p in failed.problems), failed.problems
        assert "__0_0.distcp: altered" in out.read_text()
    finally:
        fs.pipe_file(key, original)

    # Deleted from the bucket, and the deletion recorded: described from its tombstone row.
    fs.rm(f"{root.removeprefix('s3://')}/step-1", recursive=True)
    assert cli.main(["lineage", str(run_dir), "--record-deletions"]) == 0
    capsys.readouterr()
    assert cli.main(["report", str(run_dir), "--out", str(out)]) == 0
    assert "1 verified, 1 deleted by retention" in capsys.readouterr().out
    deleted = collect_run(run_dir).checkpoints[0]
    assert (str(deleted.path), deleted.status) == (f"{root}/step-1", "deleted")
    assert "recorded after the fact" in deleted.tombstone["reason"]  # the statement went with the objects


def test_sign_a_checkpoint_in_the_bucket(
    bucket_run: tuple[Path, str], s3_env: S3Server, capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    """``shardline sign URL``: copied down, verified, signed; ``step-N.sig`` uploaded beside the prefix, where
    ``verify --public-key`` and ``report --public-key`` find it."""
    pytest.importorskip("model_signing", reason="the [signing] extra is not installed")
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    keys = {}
    for name in ("mine", "other"):
        key = ec.generate_private_key(ec.SECP256R1())
        private, public = tmp_path / f"{name}.pem", tmp_path / f"{name}.pub.pem"
        encoding, none = serialization.Encoding.PEM, serialization.NoEncryption()
        private.write_bytes(key.private_bytes(encoding, serialization.PrivateFormat.PKCS8, none))
        public.write_bytes(key.public_key().public_bytes(encoding, serialization.PublicFormat.SubjectPublicKeyInfo))
        keys[name] = (str(private), str(public))
    run_dir, root = bucket_run
    url, fs = f"{root}/step-2", s3_env.filesystem()
    digest = collect_run(run_dir).checkpoints[-1].row.manifest_sha256

    assert cli.main(["sign", url, "--private-key", keys["mine"][0], "--expect", digest]) == 0
    assert f"Signed {url} " in capsys.readouterr().out
    assert fs.isfile(f"{url.removeprefix('s3://')}.sig")
    assert cli.main(["verify", url, "--public-key", keys["mine"][1]]) == 0
    assert f"OK: signature {url}.sig verifies" in capsys.readouterr().out
    facts = collect_run(run_dir, public_key=keys["mine"][1]).checkpoints[-1]
    assert (str(facts.signature), facts.signature_ok) == (f"{url}.sig", True)
    # Another key's public half: refused. Signing again without --force: refused, the signature kept.
    assert cli.main(["verify", url, "--public-key", keys["other"][1]]) == 1
    assert f"does not verify for {url}: Key mismatch" in capsys.readouterr().err
    assert cli.main(["sign", url, "--private-key", keys["other"][0]]) == 1
    assert "already exists" in capsys.readouterr().err

    # A flipped byte in the bucket: the signature no longer verifies, naming the object; signing refuses.
    key = f"{url.removeprefix('s3://')}/shards/0000/__0_0.distcp"
    original = _flip(fs, key)
    try:
        assert cli.main(["verify", url, "--public-key", keys["mine"][1]]) == 1
        err = capsys.readouterr().err
        assert f"does not verify for {url}" in err
        assert "__0_0.distcp: altered" in err
        assert cli.main(["sign", url, "--private-key", keys["mine"][0], "--force"]) == 1
        assert "refusing to sign" in capsys.readouterr().err
    finally:
        fs.pipe_file(key, original)
    fs.rm_file(f"{url.removeprefix('s3://')}.sig")


def test_an_unreachable_bucket_is_one_line_and_exit_2(
    bucket_run: tuple[Path, str], s3_env: S3Server, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir, _ = bucket_run
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    commands = (
        ["report", str(run_dir), "--out", str(run_dir / "r.html")],
        ["lineage", str(run_dir)],
        ["lineage", str(run_dir), "--record-deletions"],
    )
    rows = len(Ledger(run_dir / "lineage.sqlite").rows())
    for command in commands:
        assert cli.main(command) == 2
        captured = capsys.readouterr()
        lines = captured.err.strip().splitlines()
        assert len(lines) == 1, captured.err
        assert endpoint in lines[0]
        assert f"bucket {S3_BUCKET!r}" in lines[0]
        assert "Traceback" not in captured.err
    assert not (run_dir / "r.html").exists()
    assert len(Ledger(run_dir / "lineage.sqlite").rows()) == rows, "an unreachable bucket buried nothing"
