"""``adopt(subfolders=True)``: a folder of DCP checkpoints beside loose files, as a Hugging Face Trainer writes
``checkpoint-N`` under Accelerate's FSDP (``pytorch_model_fsdp_0/``, ``optimizer_0/``, ``trainer_state.json``...).

Written here by plain ``dcp.save`` in one process, with the layout and state-dict keys Accelerate uses; the
real Trainer's folder is adopted by tests/hf/test_lineage_callback.py.
"""

from __future__ import annotations

import json
import uuid
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

import shardline.checkpoint as ckpt
from shardline import cli
from shardline.checkpoint.integrity.manifest import read_manifest
from shardline.checkpoint.provenance.records import adoption
from shardline.errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    ConfigurationError,
    IntegrityError,
)
from tests.checkpoint import adopt_ranks
from tests.checkpoint.conftest import S3_BUCKET
from tests.checkpoint.seaweed import S3Server

pytestmark = pytest.mark.timeout(120)

PARENT = "ab" * 32


def _trainer_folder(path: Path) -> Path:
    """``run/checkpoint-3`` laid out as Accelerate's FSDP save and Trainer leave it."""
    model = adopt_ranks.tiny()
    optimizer = adopt_ranks.trained(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(path / "pytorch_model_fsdp_0"), no_dist=True)
        dcp.save(
            {"optimizer": get_optimizer_state_dict(model, optimizer)},
            checkpoint_id=str(path / "optimizer_0"),
            no_dist=True,
        )
    (path / "trainer_state.json").write_text(json.dumps({"global_step": 3}))
    torch.save({"last_epoch": 3}, path / "scheduler.pt")
    torch.save({"python": 1}, path / "rng_state_0.pth")
    return path


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    return _trainer_folder(tmp_path / "run" / "checkpoint-3")


def test_trainer_folder_is_adopted_with_every_file_hashed_and_verifies(folder: Path) -> None:
    done = ckpt.adopt(folder, subfolders=True, parent_manifest_hash=PARENT)
    assert (done.step, done.world_size, done.parent_manifest_hash) == (3, 1, PARENT)  # step from checkpoint-N
    assert done.extra_files == ("rng_state_0.pth", "scheduler.pt", "trainer_state.json")
    manifest, digest = read_manifest(folder)
    listed = {f["path"] for f in manifest["files"]}
    on_disk = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    assert listed == on_disk - {"manifest.json", "manifest.sha256", "SHA256SUMS"}
    assert {"pytorch_model_fsdp_0/.metadata", "optimizer_0/.metadata", "trainer_state.json"} <= listed
    assert manifest["parent_manifest_sha256"] == PARENT
    assert "parent" not in manifest["adopted"]["unknown"]
    assert (manifest["contents"]["model"], manifest["contents"]["optimizer"]) == (True, True)
    assert manifest["model"]["state"]["0.weight"] == [[16, 8], "float32"]
    report = ckpt.verify_checkpoint(folder)
    assert report.ok, report
    row = ckpt.Ledger(folder.parent / "lineage.sqlite").rows()[-1]
    assert (row.checkpoint, row.manifest_sha256, row.parent_manifest_sha256) == ("checkpoint-3", digest, PARENT)
    assert adoption(row) is not None
    assert cli.main(["verify", str(folder)]) == 0


def test_load_and_consolidate_say_the_layout_is_not_theirs_rather_than_damaged(folder: Path, tmp_path: Path) -> None:
    ckpt.adopt(folder, subfolders=True)
    for attempt in (
        lambda: ckpt.consolidate(folder, tmp_path / "export"),
        lambda: ckpt.load(folder, model=adopt_ranks.tiny()),
    ):
        with pytest.raises(CheckpointError, match=r"DCP checkpoints in subfolders.*Resume it with the Trainer") as info:
            attempt()
        assert not isinstance(info.value, IntegrityError)  # not reported (nor quarantined) as damage
    assert ckpt.verify_checkpoint(folder).ok


@pytest.mark.parametrize(
    "damage", ["optimizer_0/__0_0.distcp", "pytorch_model_fsdp_0/.metadata", "trainer_state.json", "extra"]
)
def test_a_changed_or_added_file_in_an_adopted_trainer_folder_fails_verify(folder: Path, damage: str) -> None:
    ckpt.adopt(folder, subfolders=True)
    if damage == "extra":
        (folder / "optimizer_0" / "stray.bin").write_bytes(b"x")
    else:
        data = bytearray((folder / damage).read_bytes())
        data[len(data) // 2] ^= 0x01
        (folder / damage).write_bytes(bytes(data))
    report = ckpt.verify_checkpoint(folder)
    assert not report.ok
    kind = "unexpected" if damage == "extra" else "altered"
    assert [(p.path, p.kind) for p in report.problems] == [
        ("optimizer_0/stray.bin" if damage == "extra" else damage, kind)
    ]


def test_what_is_not_a_complete_trainer_folder_is_refused_with_nothing_written(folder: Path) -> None:
    before = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*"))
    with pytest.raises(
        CheckpointNotFoundError, match=r"subfolders optimizer_0, pytorch_model_fsdp_0 hold.*--subfolders"
    ):
        ckpt.adopt(folder)  # without the option: the old refusal, now naming it
    (folder / "optimizer_0" / ".metadata").rename(folder / "optimizer_0" / ".metadata.tmp")
    with pytest.raises(CheckpointNotFoundError, match=r"subfolder optimizer_0: it has no \.metadata.*never finished"):
        ckpt.adopt(folder, subfolders=True)
    (folder / "optimizer_0" / ".metadata.tmp").rename(folder / "optimizer_0" / ".metadata")
    (folder / "pytorch_model_fsdp_0" / "__0_0.distcp").unlink()
    with pytest.raises(IntegrityError, match=r"subfolder pytorch_model_fsdp_0.*__0_0\.distcp.*missing"):
        ckpt.adopt(folder, subfolders=True)
    with pytest.raises(ConfigurationError, match="parent_manifest_hash"):
        ckpt.adopt(folder, subfolders=True, parent_manifest_hash="not-a-hash")
    after = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*"))
    assert after == [p for p in before if p != "pytorch_model_fsdp_0/__0_0.distcp"]
    assert not (folder.parent / "lineage.sqlite").exists()


def test_a_shardline_checkpoint_inside_is_refused(tmp_path: Path) -> None:
    folder = _trainer_folder(tmp_path / "checkpoint-3")
    ckpt.adopt(folder / "optimizer_0", step=3, ledger=tmp_path)
    with pytest.raises(CheckpointExistsError, match=r"subfolder optimizer_0 holds.*manifest\.json"):
        ckpt.adopt(folder, subfolders=True, ledger=tmp_path)


def test_cli_adopts_a_trainer_folder(folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["adopt", str(folder), "--subfolders", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["step"], out["files"]) == (3, 7)  # two DCP folders of two files, three loose
    assert ckpt.verify_checkpoint(folder).ok


def test_a_trainer_folder_in_an_object_store_is_adopted_and_a_changed_object_fails_verify(
    s3_server: S3Server, folder: Path, tmp_path: Path
) -> None:
    options = s3_server.storage_options()
    prefix = f"{S3_BUCKET}/adopt-{uuid.uuid4().hex[:12]}/checkpoint-3"
    fs = s3_server.filesystem()
    for file in sorted(p for p in folder.rglob("*") if p.is_file()):
        fs.put_file(str(file), f"{prefix}/{file.relative_to(folder).as_posix()}")
    url = f"s3://{prefix}"
    done = ckpt.adopt(url, ledger=tmp_path, subfolders=True, storage_options=options)
    assert (done.step, done.world_size, done.files) == (3, 1, 7)
    assert ckpt.verify_checkpoint(url, storage_options=options).ok
    fs.pipe_file(f"{prefix}/optimizer_0/__0_0.distcp", b"changed")
    report = ckpt.verify_checkpoint(url, storage_options=options)
    assert [(p.path, p.kind) for p in report.problems] == [("optimizer_0/__0_0.distcp", "altered")]
