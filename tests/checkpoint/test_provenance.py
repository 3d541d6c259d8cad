"""The in-toto provenance statement of each checkpoint, its place in the manifest and the ledger, and the git lookup."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from shardline import cli
from shardline.checkpoint import Ledger
from shardline.checkpoint.lifecycle.summary import summarize
from shardline.checkpoint.provenance.statement import (
    PREDICATE_TYPE,
    STATEMENT_FILE,
    git_commit,
    read_statement,
    statement_problems,
)
from tests.checkpoint.ranks import CONFIG


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _tagged(value):
    """The config with floats written {"$float": repr(x)} -- by hand, as docs/provenance.md describes."""
    if isinstance(value, float):
        return {"$float": repr(value)}
    if isinstance(value, dict):
        return {k: _tagged(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_tagged(v) for v in value]
    return value


def test_statement_says_where_the_checkpoint_came_from(saved_run: Path) -> None:
    step = saved_run / "step-4"
    raw = (step / STATEMENT_FILE).read_bytes()
    statement = json.loads(raw)
    # canonical JSON, like the manifest: the file is its own canonical form
    assert raw == json.dumps(statement, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    assert statement["_type"] == "https://in-toto.io/Statement/v1"
    assert statement["predicateType"] == PREDICATE_TYPE
    # subject: the manifest, by its SHA-256 recomputed here from the bytes on disk (it names every data file)
    assert statement["subject"] == [{"name": "manifest.json", "digest": {"sha256": _sha(step / "manifest.json")}}]
    p = statement["predicate"]
    tagged = _tagged(CONFIG)
    assert p["training_config"]["resolved"] == tagged
    canonical = json.dumps(tagged, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    assert p["training_config"]["sha256"] == hashlib.sha256(canonical).hexdigest()
    assert p["data"]["fingerprint"] == "synthetic-batches-v1"
    assert p["parent"]["manifest_sha256"] == _sha(saved_run / "step-2" / "manifest.json")
    assert p["runtime"]["torch"] == torch.__version__.split("+")[0]
    assert p["distributed"]["world_size"] == 2
    assert p["distributed"]["strategy"] == "full_shard"
    assert p["checkpoint"]["step"] == 4
    assert p["code"]["name"] == "shardline"
    assert p["code"]["version"]
    git = shutil.which("git")
    if git is not None:
        root = Path(__file__).resolve().parents[2]
        head = subprocess.run([git, "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
        if head.returncode == 0:
            assert p["code"]["git_commit"] == head.stdout.strip()
    # the manifest does not list the statement (it names the manifest); SHA256SUMS records it, and it agrees
    manifest = json.loads((step / "manifest.json").read_text())
    assert STATEMENT_FILE not in {f["path"] for f in manifest["files"]}
    assert f"{hashlib.sha256(raw).hexdigest()}  {STATEMENT_FILE}" in (step / "SHA256SUMS").read_text()
    assert statement_problems(statement, manifest) == []
    tampered = json.loads(raw)
    tampered["predicate"]["data"]["fingerprint"] = "other-data"
    assert any("data fingerprint" in p for p in statement_problems(tampered, manifest))
    tampered = json.loads(raw)
    tampered["subject"][0]["digest"]["sha256"] = "0" * 64
    assert any("manifest hash" in p for p in statement_problems(tampered, manifest))
    # `shardline inspect` still says the checkpoint has one, and counts only the data files
    summary = summarize(step)
    assert summary["provenance_statement"] == STATEMENT_FILE
    assert summary["files"] == len(manifest["files"])


def test_ledger_chains_the_statements_and_lineage_json_emits_them(saved_run: Path, capsys) -> None:
    rows = Ledger(saved_run / "lineage.sqlite").rows()
    for row in rows:
        detail = json.loads(row.detail)
        assert detail["provenance"]["sha256"] == _sha(saved_run / row.checkpoint / STATEMENT_FILE)
    assert cli.main(["lineage", "--json", str(saved_run)]) == 0
    out = json.loads(capsys.readouterr().out)
    for row in out["rows"]:
        prov = row["provenance"]
        assert prov["source"] == "checkpoint"
        assert prov["matches_ledger"] is True
        assert prov["statement"] == json.loads((saved_run / row["checkpoint"] / STATEMENT_FILE).read_text())


def test_an_altered_statement_fails_verification(saved_run: Path, tmp_path: Path) -> None:
    from shardline.checkpoint import verify_checkpoint

    step = tmp_path / "step-4"
    shutil.copytree(saved_run / "step-4", step)
    data = json.loads((step / STATEMENT_FILE).read_text())
    data["predicate"]["parent"]["manifest_sha256"] = "0" * 64
    (step / STATEMENT_FILE).write_bytes(json.dumps(data, sort_keys=True, separators=(",", ":")).encode())
    report = verify_checkpoint(step)
    assert not report.ok
    assert [p.path for p in report.problems] == [STATEMENT_FILE]
    assert read_statement(step) is not None  # still well-formed: only its hash gives it away


def test_the_statement_is_checked_as_a_record_derived_from_the_manifest(saved_run: Path, tmp_path: Path) -> None:
    """Deleted: missing (SHA256SUMS records it). Swapped for one naming another manifest, SHA256SUMS rewritten to
    match: altered, because its subject must be this checkpoint's manifest hash."""
    from shardline.checkpoint import verify_checkpoint

    gone = tmp_path / "gone"
    shutil.copytree(saved_run / "step-4", gone)
    (gone / STATEMENT_FILE).unlink()
    report = verify_checkpoint(gone)
    assert [(p.path, p.kind) for p in report.problems] == [(STATEMENT_FILE, "missing")]

    swapped = tmp_path / "swapped"
    shutil.copytree(saved_run / "step-4", swapped)
    shutil.copy(saved_run / "step-2" / STATEMENT_FILE, swapped / STATEMENT_FILE)  # step-2's: names step-2's manifest
    sums = (
        (swapped / "SHA256SUMS")
        .read_text()
        .replace(_sha(saved_run / "step-4" / STATEMENT_FILE), _sha(swapped / STATEMENT_FILE))
    )
    (swapped / "SHA256SUMS").write_text(sums)
    report = verify_checkpoint(swapped)
    assert [(p.path, p.kind) for p in report.problems] == [(STATEMENT_FILE, "altered")]
    assert _sha(saved_run / "step-2" / "manifest.json") in report.problems[0].detail
    assert verify_checkpoint(saved_run / "step-4").ok


def _repo(root: Path, head: str) -> Path:
    (root / ".git" / "refs" / "heads").mkdir(parents=True)
    (root / ".git" / "HEAD").write_text(head)
    return root / ".git"


def test_git_commit_is_read_from_the_checkout(tmp_path: Path) -> None:
    sha = "a" * 40
    loose = _repo(tmp_path / "loose", "ref: refs/heads/main\n")
    (loose / "refs" / "heads" / "main").write_text(sha + "\n")
    (tmp_path / "loose" / "src" / "pkg").mkdir(parents=True)
    assert git_commit(tmp_path / "loose" / "src" / "pkg") == (sha, tmp_path / "loose")
    packed = _repo(tmp_path / "packed", "ref: refs/heads/dev\n")
    (packed / "packed-refs").write_text(f"# pack-refs with: peeled\n{'b' * 40} refs/heads/dev\n")
    assert git_commit(tmp_path / "packed") == ("b" * 40, tmp_path / "packed")
    _repo(tmp_path / "detached", "c" * 40 + "\n")
    assert git_commit(tmp_path / "detached")[0] == "c" * 40
    # a worktree: .git is a file pointing at its git dir, whose refs live in the common dir
    common = _repo(tmp_path / "main", "ref: refs/heads/main\n")
    (common / "refs" / "heads" / "wt").write_text("d" * 40)
    wt_git = common / "worktrees" / "wt"
    wt_git.mkdir(parents=True)
    (wt_git / "HEAD").write_text("ref: refs/heads/wt\n")
    (wt_git / "commondir").write_text("../..\n")
    (tmp_path / "wt").mkdir()
    (tmp_path / "wt" / ".git").write_text(f"gitdir: {wt_git}\n")
    assert git_commit(tmp_path / "wt")[0] == "d" * 40


@pytest.mark.parametrize("head", ["ref: refs/heads/missing\n", "garbage\n"])
def test_git_commit_skips_what_it_cannot_resolve(tmp_path: Path, head: str) -> None:
    _repo(tmp_path / "r", head)
    assert git_commit(tmp_path / "r") is None
    outside = tmp_path / "plain"
    outside.mkdir()
    found = git_commit(outside)
    assert found is None or found[1] not in (outside, tmp_path)  # only an enclosing checkout, never a made-up one
