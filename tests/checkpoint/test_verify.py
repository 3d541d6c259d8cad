"""``shardline verify``: exit 0 when everything matches; exit 1 naming each missing, altered or extra file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from shardline import cli
from shardline.checkpoint import verify_checkpoint
from tests.models import ParityModel

FILE_KINDS = [".metadata", "__0_0.distcp", "__1_0.distcp", "manifest.json", "manifest.sha256", "SHA256SUMS"]


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset % len(data)] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.compat
def test_verify_ok(saved_run: Path, capsys) -> None:
    assert cli.main(["verify", str(saved_run / "step-4")]) == 0
    assert "OK" in capsys.readouterr().out
    assert cli.main(["verify", "--json", str(saved_run / "step-4")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"]
    assert out["problems"] == []
    assert out["step"] == 4


@pytest.mark.parametrize("name", FILE_KINDS)
def test_flipped_byte_in_every_file_kind(damaged_copy: Path, name: str, capsys) -> None:
    # a byte in the middle of the file: hashes catch what sizes cannot
    _flip(damaged_copy / name, (damaged_copy / name).stat().st_size // 2)
    assert cli.main(["verify", "--json", str(damaged_copy)]) == 1
    report = json.loads(capsys.readouterr().out)
    assert not report["ok"]
    assert name in {p["path"] for p in report["problems"] if p["problem"] == "altered"}, report


def test_missing_and_unexpected_files(damaged_copy: Path, capsys) -> None:
    (damaged_copy / "__1_0.distcp").unlink()
    (damaged_copy / "notes.txt").write_text("hello")
    assert cli.main(["verify", str(damaged_copy)]) == 1
    err = capsys.readouterr().err
    assert "missing" in err
    assert "__1_0.distcp" in err
    assert "unexpected" in err
    assert "notes.txt" in err


def test_truncated_shard_caught_at_sizes_level(damaged_copy: Path) -> None:
    shard = damaged_copy / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-10])
    report = verify_checkpoint(damaged_copy, level="sizes")
    assert [(p.path, p.kind) for p in report.problems] == [("__0_0.distcp", "altered")]


def test_expected_manifest_hash(saved_run: Path, capsys) -> None:
    assert cli.main(["verify", "--expect", "0" * 64, str(saved_run / "step-4")]) == 1
    assert "expected" in capsys.readouterr().err


def test_not_a_checkpoint(tmp_path: Path, capsys) -> None:
    assert cli.main(["verify", str(tmp_path)]) == 1
    assert "not a checkpoint" in capsys.readouterr().err


@pytest.mark.compat
def test_plain_torch_reads_the_checkpoint(saved_run: Path) -> None:
    """(b) readable by plain torch.distributed.checkpoint: load the model part into an unsharded model."""
    model = ParityModel()
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(saved_run / "step-4"), no_dist=True)
    model.load_state_dict(state["model"])
    assert torch.isfinite(model.emb.weight).all()
    assert torch.equal(model.emb.weight, model.head.weight)
