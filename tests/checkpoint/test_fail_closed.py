"""Fault injection: checkpoints fail closed -- nothing unverified is loaded, resumed or exported.

Each test damages a private copy of a committed run the way the issue's campaign did and checks
that load, resume and consolidate refuse (naming the file) or fall back, that a tampered
``.metadata`` is never unpickled, that the ledger notices a missing tail, and that a full disk
gives one clear line and leaves the previous checkpoint intact.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import re
import shutil
import sqlite3
import subprocess
from pathlib import Path

import pytest
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import shardline.checkpoint as ckpt
from shardline import cli
from shardline.checkpoint.format.canonical import canonical_json
from shardline.checkpoint.integrity.manifest import read_manifest
from shardline.errors import IntegrityError, LineageError
from shardline.testing import run_distributed
from tests.checkpoint import failing, ranks

FILE_KINDS = [".metadata", "__0_0.distcp", "__1_0.distcp", "manifest.json", "manifest.sha256", "SHA256SUMS"]
DOCS = Path(__file__).resolve().parents[2] / "docs" / "verification.md"


def _documented(marker: str) -> str:
    match = re.search(rf"<!-- {marker} -->\s*```bash\n(.+?)\n```", DOCS.read_text(encoding="utf-8"), re.S)
    assert match, f"docs/verification.md must show a command after <!-- {marker} -->"
    return match.group(1)


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


class _Marker:
    """Unpickling this creates ``path``: what a malicious ``.metadata`` could do."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _evil_metadata(marker: Path, control: Path) -> bytes:
    data = pickle.dumps(_Marker(marker))
    pickle.loads(pickle.dumps(_Marker(control))).close()  # the same construction really runs code
    assert control.is_file()
    return data


def _rewrite_manifest(step: Path) -> None:
    """Make manifest.json, manifest.sha256 and SHA256SUMS agree with the files, as someone who controls the
    directory could: only a manifest hash recorded elsewhere (ledger, --expect) tells it from the original."""
    manifest = json.loads((step / "manifest.json").read_text())
    for entry in manifest["files"]:
        data = (step / entry["path"]).read_bytes()
        entry["bytes"], entry["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    raw = canonical_json(manifest)
    digest = hashlib.sha256(raw).hexdigest()
    (step / "manifest.json").write_bytes(raw)
    (step / "manifest.sha256").write_text(f"{digest}  manifest.json\n")
    rows = {e["path"]: e["sha256"] for e in manifest["files"]} | {"manifest.json": digest}
    statement = step / "provenance.intoto.json"
    if statement.is_file() and "provenance.intoto.json" not in rows:  # it names the manifest: named anew
        named = json.loads(statement.read_text())
        named["subject"] = [{"name": "manifest.json", "digest": {"sha256": digest}}]
        statement.write_bytes(canonical_json(named))
        rows["provenance.intoto.json"] = hashlib.sha256(statement.read_bytes()).hexdigest()
    (step / "SHA256SUMS").write_text("".join(f"{h}  {n}\n" for n, h in sorted(rows.items())))


def _damaged_copies(saved_run: Path, root: Path) -> dict[str, Path]:
    good = saved_run / "step-4"
    copies: dict[str, Path] = {}

    def copy(name: str) -> Path:
        copies[name] = root / name
        shutil.copytree(good, copies[name])
        return copies[name]

    for kind in FILE_KINDS:
        _flip(copy(f"flip{kind}") / kind)
    (copy("missing") / "__1_0.distcp").unlink()
    (copy("extra") / "notes.txt").write_text("not part of the checkpoint")
    shard = copy("truncated") / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-10])
    _flip_tensor_pickle(copy("flip-pickle") / "__0_0.distcp")
    return copies


def _flip_tensor_pickle(shard: Path) -> None:
    """Flip one bit inside the pickle of the file's first tensor item: ``_rebuild_tensor_v2`` reads ``..._v3``,
    so the item no longer deserializes (the reader's decoder and torch.load both decline it)."""
    metadata = FileSystemReader(str(shard.parent)).read_metadata()
    offset, length = min(
        (info.offset, info.length)
        for index, info in metadata.storage_data.items()
        if info.relative_path == shard.name
        and isinstance(metadata.state_dict_metadata[index.fqn], TensorStorageMetadata)
    )
    data = bytearray(shard.read_bytes())
    at = data.index(b"_rebuild_tensor_v2", offset) + len(b"_rebuild_tensor_v")
    assert at < offset + length, "the flip must land inside that tensor item"
    data[at] ^= 0x01  # "2" -> "3"
    shard.write_bytes(bytes(data))


def _expected_file(name: str) -> str:
    return {
        "missing": "__1_0.distcp",
        "extra": "notes.txt",
        "truncated": "__0_0.distcp",
        "flip-pickle": "__0_0.distcp",
    }.get(name, name.removeprefix("flip"))


def test_load_and_consolidate_refuse_damage_naming_the_file(saved_run: Path, tmp_path: Path) -> None:
    copies = _damaged_copies(saved_run, tmp_path)
    results = run_distributed(failing.load_each, 2, args=([str(p) for p in copies.values()], {}), timeout=90)
    assert results[0] == results[1], "every rank raises the same error"
    for name, path in copies.items():
        kind, message = results[0][str(path)]
        assert kind == "IntegrityError", (name, kind, message)
        assert _expected_file(name) in message, (name, message)
        assert "it was not" in message, message
        with pytest.raises(IntegrityError, match=_expected_file(name).replace(".", r"\.")):
            ckpt.consolidate(path, tmp_path / f"out-{name}")
        assert not (tmp_path / f"out-{name}").exists()


def test_a_tampered_metadata_is_never_unpickled(saved_run: Path, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    evil = _evil_metadata(marker, tmp_path / "control")
    recorded = read_manifest(saved_run / "step-4")[1]
    swapped = tmp_path / "swapped"  # .metadata replaced, manifest left alone
    shutil.copytree(saved_run / "step-4", swapped)
    (swapped / ".metadata").write_bytes(evil)
    forged = tmp_path / "forged"  # .metadata replaced and the manifest files rewritten to match it
    shutil.copytree(saved_run / "step-4", forged)
    (forged / ".metadata").write_bytes(evil)
    _rewrite_manifest(forged)
    assert ckpt.verify_checkpoint(forged).ok, "a consistent rewrite passes the in-directory checks"

    results = run_distributed(failing.load_each, 2, args=([str(swapped), str(forged)], {}), timeout=90)
    assert ".metadata: altered" in results[0][str(swapped)][1]
    assert "it refers to io.open" in results[0][str(forged)][1], "the allowlist refuses what the forged hash let in"
    anchored = run_distributed(failing.load_each, 1, args=([str(forged)], {str(forged): recorded}), timeout=60)
    assert "trusted record" in anchored[0][str(forged)][1], "the ledger's hash catches the rewrite first"
    for path in (swapped, forged):
        with pytest.raises(IntegrityError):
            ckpt.consolidate(path, tmp_path / f"out-{path.name}")
        with pytest.raises(IntegrityError):
            ckpt.load_config(path)
    with pytest.raises(IntegrityError):
        ckpt.load_config(forged, verify="none")
    assert not marker.exists(), "a .metadata pickle ran code"


def test_resume_auto_falls_back_moves_the_damage_aside_and_records_it(saved_run: Path, tmp_path: Path) -> None:
    directory = tmp_path / "checkpoints"
    shutil.copytree(saved_run, directory)
    _flip(directory / "step-4" / "__0_0.distcp")
    reference = run_distributed(ranks.run_with_manager, 2, args=(str(tmp_path / "ref"), 6, [], False), timeout=60)[0]
    out = run_distributed(failing.resume_over_damage, 2, args=(str(directory),), timeout=90)[0]
    assert out["start"] == 2, "the newest checkpoint that verifies"
    assert out["losses"] == reference[2:], "bit-identical from step 2"
    assert len(out["moved"]) == 1, out["moved"]
    assert out["moved"][0].startswith("step-4.damaged-"), out["moved"]
    assert (directory / out["moved"][0] / "__0_0.distcp").is_file(), "moved aside, nothing deleted"
    assert out["parent_of_4"] == read_manifest(directory / "step-2")[1]
    assert out["sizes_resumed_from"] == "step-6"
    rows = ckpt.Ledger(directory / "lineage.sqlite").rows()
    assert [(r.event or "commit", r.step) for r in rows] == [
        ("commit", 2),
        ("commit", 4),
        ("quarantine", 4),
        ("commit", 4),
        ("commit", 6),
        ("resume", 6),
    ]
    assert json.loads(rows[2].detail)["moved_to"] == out["moved"][0]
    assert "__0_0.distcp" in json.loads(rows[2].detail)["reason"]
    assert json.loads(rows[5].detail)["verify"] == "sizes", "the opt-in is recorded"
    report = ckpt.audit(ckpt.Ledger(directory / "lineage.sqlite"))
    assert report.ok, report.problems
    # the documented python3-only checks agree, event rows included
    chain = subprocess.run(["bash", "-c", _documented("ledger-chain-command")], cwd=directory, capture_output=True,
                           text=True, check=True).stdout.splitlines()  # fmt: skip
    assert [line.split()[1] for line in chain] == ["commit", "commit", "quarantine", "commit", "commit", "resume"]
    assert all(line.endswith(" OK") for line in chain), chain
    head = subprocess.run(["bash", "-c", _documented("ledger-head-command")], cwd=directory, capture_output=True,
                          text=True, check=True).stdout  # fmt: skip
    assert head.strip() == "head OK"


def test_resume_auto_falls_back_over_damage_of_every_kind(saved_run: Path, tmp_path: Path) -> None:
    directories = {}
    for name in [*(f"flip{k}" for k in FILE_KINDS), "flip-pickle", "missing", "extra", "truncated"]:
        directory = tmp_path / name
        shutil.copytree(saved_run, directory)
        step4 = directory / "step-4"
        if name == "flip-pickle":
            _flip_tensor_pickle(step4 / "__0_0.distcp")
        elif name.startswith("flip"):
            _flip(step4 / name.removeprefix("flip"))
        elif name == "missing":
            (step4 / "__1_0.distcp").unlink()
        elif name == "extra":
            (step4 / "notes.txt").write_text("not part of the checkpoint")
        else:
            (step4 / "__0_0.distcp").write_bytes((step4 / "__0_0.distcp").read_bytes()[:-10])
        directories[name] = directory
    results = run_distributed(failing.resume_each, 2, args=([str(d) for d in directories.values()],), timeout=90)
    for name, directory in directories.items():
        step, moved = results[0][str(directory)]
        assert step == 2, (name, step)
        assert len(moved) == 1, (name, moved)
        assert moved[0].startswith("step-4.damaged-"), (name, moved)
        reason = json.loads(ckpt.Ledger(directory / "lineage.sqlite").rows()[-1].detail)["reason"]
        assert _expected_file(name) in reason, (name, reason)


def test_a_missing_ledger_tail_is_caught(saved_run: Path, tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    conn = sqlite3.connect(run / "lineage.sqlite")
    conn.execute("DROP TRIGGER checkpoints_no_delete")
    conn.execute("DELETE FROM checkpoints WHERE seq = 2")
    conn.commit()
    conn.close()
    head = subprocess.run(["bash", "-c", _documented("ledger-head-command")], cwd=run, capture_output=True,
                          text=True, check=True).stdout  # fmt: skip
    assert head.strip() == "rows missing from the end", "the documented check sees the deleted tail too"
    assert cli.main(["lineage", str(run)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("Chain BROKEN: rows are missing from the end of the ledger"), err
    assert "row 2" in err
    assert "step-4 (step 4" in err, "names the checkpoint on disk the ledger lost"
    with pytest.raises(LineageError, match="--new-chain"):
        ckpt.CheckpointManager(run)  # training refuses to append to the broken chain
    assert cli.main(["lineage", "--new-chain", str(run)]) == 0
    assert "records the break" in capsys.readouterr().out
    assert cli.main(["lineage", str(run)]) == 0
    rows = ckpt.Ledger(run / "lineage.sqlite").rows()
    assert [(r.event, r.step, r.recovered) for r in rows] == [
        ("chain_break", 0, False),
        ("commit", 2, True),
        ("commit", 4, True),
    ]
    assert list(run.glob("lineage.broken-*.sqlite")), "the broken ledger is kept"
    ckpt.CheckpointManager(run)  # the new chain verifies: training may append again


def test_an_unrecorded_checkpoint_other_than_an_interrupted_publish_is_a_gap(saved_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    (run / "lineage.sqlite").unlink()
    (run / "lineage.sqlite.head").unlink()
    with pytest.raises(LineageError, match=r"step-2 .*missing from the ledger"):
        ckpt.CheckpointManager(run)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_disk_full_names_the_cause_and_keeps_the_previous_checkpoint(tmp_path: Path, async_save: bool) -> None:
    directory = tmp_path / "checkpoints"
    results = run_distributed(failing.disk_full, 2, args=(str(directory), async_save), timeout=90)
    assert results[0] == results[1], "every rank raises the same error"
    kind, message = results[0]
    first = message.splitlines()[0]
    assert kind == "DiskFullError", message
    assert first.startswith(f"disk full: writing checkpoint {directory / 'step-2'} needs about "), first
    assert " free on " in first
    assert "No space left on device" in first
    assert f"the last good checkpoint is {directory / 'step-1'}" in first
    assert sorted(p.name for p in directory.iterdir()) == ["latest", "lineage.sqlite", "lineage.sqlite.head", "step-1"]
    assert ckpt.verify_checkpoint(directory / "step-1").ok
    assert (directory / "latest").read_text().strip() == "step-1"


def test_cli_errors_blame_the_right_thing(saved_run: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["verify", "--expect", "xyz", str(saved_run / "step-4")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --expect" in err
    assert "64 characters" in err
    assert "'xyz'" in err
    assert cli.main(["consolidate", str(saved_run / "step-4"), "/proc/x"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("error: cannot create the output directory /proc/x"), err


def test_sizes_only_export_is_recorded(saved_run: Path, tmp_path: Path, capsys) -> None:
    assert cli.main(["consolidate", "--verify", "sizes", str(saved_run / "step-4"), str(tmp_path / "out")]) == 0
    assert "warning: exporting" in capsys.readouterr().err
    sidecar = json.loads((tmp_path / "out" / "consolidation.json").read_text())
    assert sidecar["source"]["verified"] == "sizes"


def test_hashing_shares_are_disjoint_and_cover_every_file() -> None:
    from shardline.checkpoint.integrity.reading import assign_hashing

    files = {"__0_0.distcp": 100, "__1_0.distcp": 100, "__2_0.distcp": 10}
    reads = [{"__0_0.distcp": 60, "__1_0.distcp": 40}, {"__1_0.distcp": 60}, {}]
    shares = assign_hashing(files, reads)
    assert shares == [["__0_0.distcp"], ["__1_0.distcp"], ["__2_0.distcp"]]  # most read, then least loaded
    assert sorted(name for share in shares for name in share) == sorted(files)


@pytest.mark.parametrize("world", [1, 3])
def test_damage_is_caught_at_another_world_size(saved_run: Path, tmp_path: Path, world: int) -> None:
    damaged = tmp_path / "step-4"
    shutil.copytree(saved_run / "step-4", damaged)
    _flip(damaged / "__1_0.distcp")
    results = run_distributed(failing.load_each, world, args=([str(damaged)], {}), timeout=90)
    assert all(r == results[0] for r in results)
    kind, message = results[0][str(damaged)]
    assert kind == "IntegrityError", message
    assert "__1_0.distcp: altered (sha256" in message
