"""The manifest hash recomputed with plain hashlib/json, the documented procedure, and the file layout."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shardline.checkpoint.format.canonical import canonical_json, config_hash, manifest_hash
from shardline.checkpoint.integrity.manifest import read_manifest
from shardline.errors import ConfigurationError

DOCS = Path(__file__).resolve().parents[2] / "docs" / "verification.md"


def test_manifest_hash_recomputed_with_plain_hashlib_and_json(saved_run: Path) -> None:
    step = saved_run / "step-4"
    manifest = json.loads((step / "manifest.json").read_text(encoding="utf-8"))
    canonical = json.dumps(manifest, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    recomputed = hashlib.sha256(canonical).hexdigest()
    written = (step / "manifest.sha256").read_text().split()[0]
    assert recomputed == written == manifest_hash(manifest)
    # the file is stored canonically, so its plain file hash is the manifest hash too
    assert hashlib.sha256((step / "manifest.json").read_bytes()).hexdigest() == written
    assert read_manifest(step)[1] == written


def test_manifest_records_what_the_issue_lists(saved_run: Path) -> None:
    step2, step4 = (read_manifest(saved_run / n) for n in ("step-2", "step-4"))
    m = step4[0]
    assert m["step"] == 4
    assert m["world_size"] == 2
    assert m["mesh"]["shape"] == [2]
    assert m["state_dict_kind"] == "sharded"
    assert set(m["strategies"].values()) == {"full_shard"}
    assert "<root>" in m["strategies"]
    assert m["versions"]["torch"]
    assert m["versions"]["shardline"]
    assert m["config_sha256"] == config_hash({"model": "parity", "lr": 0.01, "betas": [0.9, 0.95], "steps": 6})
    assert m["data_fingerprint"] == "synthetic-batches-v1"
    assert m["parent_manifest_sha256"] == step2[1]  # lineage: step-4 descends from step-2
    assert step2[0]["parent_manifest_sha256"] is None
    assert m["hash"]["algorithm"] == "sha256"
    assert "file" in m["hash"]["covers"]
    for f in m["files"]:
        data = (saved_run / "step-4" / f["path"]).read_bytes()
        assert f["bytes"] == len(data)
        assert f["sha256"] == hashlib.sha256(data).hexdigest()
    # each rank writes one file per core it has (the automatic count, at least 1): __{rank}_{n}.distcp
    ranks_of = {f["path"]: f["rank"] for f in m["files"]}
    per_rank = sum(1 for name in ranks_of if name.startswith("__0_"))
    assert per_rank >= 1
    # the provenance statement names the manifest, so the manifest does not list it (SHA256SUMS does)
    assert ranks_of == {".metadata": 0, **{f"__{r}_{n}.distcp": r for r in (0, 1) for n in range(per_rank)}}
    assert m["model"]["tied"] == [["emb.weight", "head.weight"]]


def _documented_command() -> str:
    text = DOCS.read_text(encoding="utf-8")
    match = re.search(r"<!-- manifest-hash-command -->\s*```bash\n(.+?)\n```", text, re.S)
    assert match, "docs/verification.md must show the manifest-hash command after the marker"
    return match.group(1)


def test_documented_procedure_matches(saved_run: Path) -> None:
    step = saved_run / "step-4"
    command = _documented_command()
    assert "shardline" not in command  # standard tools only
    out = subprocess.run(["bash", "-c", command], cwd=step, capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == (step / "manifest.sha256").read_text().split()[0]
    sums = subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=step, capture_output=True, text=True)
    assert sums.returncode == 0, sums.stdout + sums.stderr
    shards = len(list(step.glob("*.distcp")))
    assert shards >= 2
    assert (
        sums.stdout.count(": OK") == 3 + shards
    )  # .metadata, the shard files, the provenance statement, manifest.json


def test_canonical_json_rules() -> None:
    assert canonical_json({"b": 1, "a": [True, None, "é"]}) == '{"a":[true,null,"é"],"b":1}'.encode()
    with pytest.raises(ConfigurationError, match=r"forbids floats, found 0\.5 at x\.y"):
        canonical_json({"x": {"y": 0.5}})
    with pytest.raises(ConfigurationError, match="string keys"):
        canonical_json({1: 2})
    assert config_hash({"lr": 0.1}) != config_hash({"lr": "0.1"})
    assert config_hash({"a": 1, "b": 2.5}) == config_hash({"b": 2.5, "a": 1})


def test_python_one_liner_in_module_doc_is_valid() -> None:
    # the same rules, spelled as in docs: run it against a synthetic manifest file
    manifest = {"format": "x", "n": 3, "s": "ü"}
    assert sys.version_info >= (3, 8)
    assert hashlib.sha256(canonical_json(manifest)).hexdigest() == manifest_hash(manifest)
