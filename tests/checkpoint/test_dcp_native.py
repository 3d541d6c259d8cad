"""shardline's DCP storage writer and reader, passed to torch.distributed.checkpoint directly (torchtitan's way).

One launch at W=2 (gloo, FSDP2) saves with ``dcp.save`` and ``dcp.async_save``, fails a save on one rank,
loads back, and loads a copy with a flipped byte; the tests below check what each left.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest

import shardline.checkpoint as ckpt
from shardline.checkpoint.provenance.ledger import LEDGER_NAME
from shardline.cli.main import main as cli_main
from shardline.errors import ConfigurationError
from shardline.testing import run_distributed
from tests.checkpoint.dcp_native_ranks import save_and_load

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("dcp_native")
    return root, run_distributed(save_and_load, 2, args=(str(root),), timeout=110)


def test_dcp_save_and_async_save_commit_verified_checkpoints(run: tuple[Path, list[dict[str, Any]]]) -> None:
    root, results = run
    ckpts = root / "checkpoints"
    sync, async_ = results[0]["sync_info"], results[0]["async_info"]
    assert (sync.step, async_.step) == (1, 2)
    assert (sync.world_size, async_.world_size) == (2, 2)
    assert results[1]["sync_info"] is None  # the commit is the coordinator's
    for info in (sync, async_):
        report = ckpt.verify_checkpoint(info.path, level="full")
        assert report.ok, report
        manifest = json.loads((info.path / "manifest.json").read_text())
        assert manifest["world_size"] == 2
        assert {f["rank"] for f in manifest["files"]} == {0, 1}  # both ranks' files hashed and listed
        sharding = manifest["sharding"]
        assert sharding["meshes"] == [{"shape": [2], "dim_names": ["dp"]}]
        assert sharding["tensors"]["app.model.0.weight"] == {"mesh": 0, "placements": ["Shard(dim=0)"]}
        assert sharding["tensors"]["train_state.step"] == "plain"
    # The async save descends from the sync one; both have commit rows in the ledger beside them.
    assert async_.parent_manifest_hash == sync.manifest_hash
    assert json.loads((async_.path / "manifest.json").read_text())["config_sha256"] is not None
    rows = [r for r in ckpt.Ledger(ckpts / LEDGER_NAME).rows() if r.is_commit]
    assert [(r.step, r.checkpoint, r.manifest_sha256) for r in rows[:2]] == [
        (1, "step-1", sync.manifest_hash),
        (2, "step-2", async_.manifest_hash),
    ]
    assert [r.checkpoint for r in rows] == ["step-1", "step-2", "step-3"]  # the failed save has no row


def test_lineage_passes(run: tuple[Path, list[dict[str, Any]]], capsys: pytest.CaptureFixture[str]) -> None:
    root, _ = run
    assert cli_main(["lineage", str(root / "checkpoints")]) == 0, capsys.readouterr()
    assert cli_main(["verify", str(root / "checkpoints" / "step-2")]) == 0, capsys.readouterr()
    capsys.readouterr()
    assert cli_main(["inspect", str(root / "checkpoints" / "step-2")]) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert "written through torch.distributed.checkpoint by code that sharded the model itself" in said, said
    assert "distributed tensors placed 2 (dp) mesh, Shard(dim=0)" in said, said
    assert "0 sharded units" not in said, "the engine's units are unknown, not absent"


def test_a_write_failing_on_one_rank_commits_nothing(run: tuple[Path, list[dict[str, Any]]]) -> None:
    _, results = run
    ledger = ["lineage.sqlite", "lineage.sqlite.head"]
    for r in results:
        assert r["failed_save"] == [
            "AttributeError: Can't pickle local object 'Unpicklable.state_dict.<locals>.<lambda>'"
        ]
        assert r["after_failure"] == [*ledger, "step-1", "step-2"]  # nothing committed
        assert r["after_retry"] == [*ledger, "step-1", "step-2", "step-3"]  # the in-progress directory is gone


def test_reader_loads_what_was_saved(run: tuple[Path, list[dict[str, Any]]]) -> None:
    _, results = run
    for r in results:
        assert r["loaded_equal"]
        assert r["loaded_step"] == 2
        assert r["reader_hash"] == results[0]["async_info"].manifest_hash


def test_reader_refuses_a_flipped_byte_before_decoding(run: tuple[Path, list[dict[str, Any]]]) -> None:
    _, results = run
    for r in results:
        assert r["flipped"], "a checkpoint with a flipped byte loaded"
        (integrity,) = [f for f in r["flipped"] if f.startswith("IntegrityError")]
        assert "__1_0.distcp: altered" in integrity, integrity
        assert "nothing was decoded from it" in integrity
        assert r["untouched"]  # no tensor of the model was written
        assert r["flipped_step"] == 0


def test_writer_arguments_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match=r"pass step= to shardline\.checkpoint\.Writer"):
        ckpt.Writer(tmp_path / "final")
    with pytest.raises(ConfigurationError, match="tag must match"):
        ckpt.Writer(tmp_path / "step-1", tag="Bad Tag")
    with pytest.raises(ConfigurationError, match="pass ledger_path="):
        ckpt.Writer("s3://bucket/run/step-1")
    with pytest.raises(ConfigurationError, match="thread executor"):
        pickle.dumps(ckpt.Writer(tmp_path / "step-1"))
    with pytest.raises(ConfigurationError, match=r"'shards' is a name the checkpoint's own files use"):
        ckpt.Writer(tmp_path / "step-1", extra_files={"shards": b"x"})  # a bucket save's data files' folder
    assert not (tmp_path / "step-1").exists()


def test_extra_files_are_written_hashed_and_committed(tmp_path: Path) -> None:
    """A framework's own file beside DCP's (Lightning's meta.pt) is listed and hashed; damage to it is caught."""
    import torch
    import torch.distributed.checkpoint as dcp

    path = tmp_path / "ckpts" / "step-3"
    (tmp_path / "ckpts").mkdir()
    writer = ckpt.Writer(path, extra_files={"meta.pt": b"the framework's own state"})
    dcp.save({"model": {"w": torch.arange(4.0)}}, storage_writer=writer)
    assert writer.info is not None
    assert (path / "meta.pt").read_bytes() == b"the framework's own state"
    listed = {f["path"] for f in json.loads((path / "manifest.json").read_text())["files"]}
    assert "meta.pt" in listed
    assert ckpt.verify_checkpoint(path, level="full").ok
    (path / "meta.pt").write_bytes(b"The framework's own state")
    report = ckpt.verify_checkpoint(path, level="full")
    assert not report.ok
    assert "meta.pt" in str(report)
    for name in (".hidden", "sub/file", "manifest.json", "__0_0.distcp", ".metadata"):
        with pytest.raises(ConfigurationError, match="extra_files name"):
            ckpt.Writer(tmp_path / "step-4", extra_files={name: b""})
    with pytest.raises(ConfigurationError, match="must be bytes"):
        ckpt.Writer(tmp_path / "step-4", extra_files={"meta.pt": "text"})  # type: ignore[dict-item]
