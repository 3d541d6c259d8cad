"""``adopt``: a checkpoint written by plain ``torch.distributed.checkpoint.save`` brought under lineage in place.

After adoption it verifies, loads, consolidates and shows in ``lineage`` like a shardline save, and its
manifest and ledger row say its hashes were taken after the fact. What cannot be adopted (a missing or
truncated chunk file, no ``.metadata``, a manifest already there) is refused with nothing written.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from cryptography.hazmat.primitives.asymmetric import ec
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

import shardline.checkpoint as ckpt
from shardline import cli
from shardline.checkpoint.provenance.records import adoption
from shardline.errors import CheckpointExistsError, CheckpointNotFoundError, ConfigurationError, IntegrityError
from shardline.testing import run_distributed
from tests.checkpoint import adopt_ranks
from tests.checkpoint.conftest import S3_BUCKET
from tests.checkpoint.seaweed import S3Server
from tests.checkpoint.test_signing import _write_key

pytestmark = pytest.mark.timeout(120)


def _plain_save(path: Path) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """What another tool writes: ``dcp.save`` of torch's own state dicts, one process."""
    model = adopt_ranks.tiny()
    optimizer = adopt_ranks.trained(model)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return model, optimizer


@pytest.fixture
def plain(tmp_path: Path) -> Path:
    """``run/step-5`` written by plain ``dcp.save``."""
    path = tmp_path / "run" / "step-5"
    _plain_save(path)
    return path


def _listing(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.parent.rglob("*")) if p.is_file()}


def _load_into_fresh(path: Path | str, **kw: object) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = adopt_ranks.tiny(seed=123)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    ckpt.load(path, model=model, optimizer=optimizer, **kw)
    return model, optimizer


def test_a_plain_dcp_save_adopted_verifies_loads_and_shows_as_adopted(
    plain: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source, source_opt = _plain_save(tmp_path / "again")  # the same model and optimizer, to compare with
    before = {p.name: p.read_bytes() for p in plain.iterdir()}

    done = ckpt.adopt(plain)

    assert (done.step, done.tag, done.world_size, done.extra_files) == (5, None, 1, ())
    assert {p.name: p.read_bytes() for p in plain.iterdir() if p.name in before} == before, "nothing rewritten"
    manifest = json.loads((plain / "manifest.json").read_bytes())
    assert "hashes taken after the fact" not in manifest["adopted"]["hashes"]  # the sentence, not a slogan
    assert manifest["adopted"]["hashes"].startswith("taken after the fact")
    assert {"units", "config", "parent"} <= set(manifest["adopted"]["unknown"])
    assert manifest["contents"]["model"]
    assert manifest["contents"]["optimizer"]
    assert manifest["model"]["state"]["0.weight"] == [[16, 8], "float32"]
    assert {f["path"] for f in manifest["files"]} == set(before)

    report = ckpt.verify_checkpoint(plain)
    assert report.ok, report
    assert report.manifest_hash == done.manifest_hash
    [row] = ckpt.Ledger(plain.parent / "lineage.sqlite").rows()
    assert row.is_commit
    assert row.manifest_sha256 == done.manifest_hash
    assert row.step == 5
    assert adoption(row) is not None
    assert adoption(row)["hashes"].startswith("taken after the fact")
    assert ckpt.audit(ckpt.Ledger(plain.parent / "lineage.sqlite")).ok

    model, optimizer = _load_into_fresh(plain)
    for (name, a), b in zip(source.state_dict().items(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    want, got = source_opt.state_dict()["state"], optimizer.state_dict()["state"]
    assert want.keys() == got.keys()
    for i in want:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(want[i][key], got[i][key]), (i, key)

    assert cli.main(["verify", str(plain)]) == 0
    assert cli.main(["lineage", str(plain.parent)]) == 0
    assert "adopted: written by another tool, hashes taken after the fact" in capsys.readouterr().out
    assert cli.main(["inspect", str(plain)]) == 0
    assert "hashes were taken after the fact" in capsys.readouterr().out
    out = tmp_path / "hf"
    assert cli.main(["consolidate", str(plain), str(out)]) == 0
    assert any(p.suffix == ".safetensors" for p in out.iterdir())
    private, public = _write_key(tmp_path, "signer", ec.generate_private_key(ec.SECP256R1()))
    assert cli.main(["sign", str(plain), "--private-key", str(private)]) == 0
    assert cli.main(["verify", str(plain), "--public-key", str(public)]) == 0
    page = tmp_path / "report.html"
    assert cli.main(["report", str(plain.parent), "--out", str(page)]) == 0
    assert "hashes were taken after the fact" in page.read_text()


def test_a_byte_flipped_after_adoption_is_refused(plain: Path) -> None:
    ckpt.adopt(plain)
    shard = plain / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    report = ckpt.verify_checkpoint(plain)
    assert [(p.path, p.kind) for p in report.problems] == [("__0_0.distcp", "altered")]
    with pytest.raises(IntegrityError, match=r"__0_0\.distcp"):
        _load_into_fresh(plain)


def _drop_shard(path: Path) -> None:
    (path / "__0_0.distcp").unlink()


def _truncate(path: Path) -> None:
    shard = path / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])


def _drop_metadata(path: Path) -> None:
    (path / ".metadata").unlink()


def _adopt_twice(path: Path) -> None:
    ckpt.adopt(path)


def _own_sums(path: Path) -> None:
    (path / "SHA256SUMS").write_text("my own\n")


@pytest.mark.parametrize(
    ("damage", "error", "message"),
    [
        (_drop_shard, IntegrityError, r"__0_0\.distcp \(holding .*\) is missing"),
        (_truncate, IntegrityError, r"__0_0\.distcp is 100 bytes but .* is recorded at bytes \d+\.\.\d+ \(truncated\)"),
        (_drop_metadata, CheckpointNotFoundError, r"it has no \.metadata, so it is not a finished"),
        (_adopt_twice, CheckpointExistsError, r"already has a manifest\.json: it is under lineage already"),
        (_own_sums, CheckpointExistsError, r"holds SHA256SUMS but no manifest\.json"),
    ],
    ids=["missing-chunk-file", "truncated-file", "no-metadata", "already-a-manifest", "a-file-of-its-own"],
)
def test_what_cannot_be_adopted_is_refused_with_nothing_written(
    plain: Path, damage, error: type[Exception], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    damage(plain)
    before = _listing(plain)
    with pytest.raises(error, match=message):
        ckpt.adopt(plain)
    assert _listing(plain) == before
    assert cli.main(["adopt", str(plain)]) == 1
    assert "nothing was written" in capsys.readouterr().err
    assert _listing(plain) == before


def test_the_step_comes_from_the_name_or_is_asked_for(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "exported"
    _plain_save(path)
    with pytest.raises(ConfigurationError, match=r"pass step=N \(--step N\)"):
        ckpt.adopt(path)
    ledger = tmp_path / "elsewhere" / "lineage.sqlite"
    ledger.parent.mkdir()
    assert cli.main(["adopt", str(path), "--step", "12", "--ledger", str(ledger.parent)]) == 0
    out = capsys.readouterr().out
    assert "Adopted" in out
    assert "as step 12" in out
    assert "taken after the fact" in out
    [row] = ckpt.Ledger(ledger).rows()
    assert (row.step, row.checkpoint) == (12, os.path.relpath(path, ledger.parent))
    assert ckpt.verify_checkpoint(path).ok


def test_an_fsdp2_checkpoint_of_two_ranks_adopted_loads_into_one_process(tmp_path: Path) -> None:
    path = tmp_path / "step-1"
    run_distributed(adopt_ranks.save_fsdp2, 2, args=(str(path),), timeout=90)
    done = ckpt.adopt(path)
    assert done.world_size == 2
    assert ckpt.verify_checkpoint(path).ok
    reference = adopt_ranks.tiny()
    reference_opt = adopt_ranks.trained(reference)
    model, optimizer = _load_into_fresh(path)
    for (name, a), b in zip(reference.state_dict().items(), model.state_dict().values(), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=name)
    got = optimizer.state_dict()["state"]
    for i, want in reference_opt.state_dict()["state"].items():
        torch.testing.assert_close(got[i]["exp_avg"], want["exp_avg"], rtol=0, atol=1e-6)


def test_adopt_in_an_object_store(s3_server: S3Server, tmp_path: Path) -> None:
    local = tmp_path / "local" / "step-9"
    source, _ = _plain_save(local)
    options = s3_server.storage_options()
    prefix = f"{S3_BUCKET}/adopt-{uuid.uuid4().hex[:12]}/step-9"
    fs = s3_server.filesystem()
    for file in local.iterdir():
        fs.put_file(str(file), f"{prefix}/{file.name}")
    url = f"s3://{prefix}"
    with pytest.raises(ConfigurationError, match="needs a ledger"):
        ckpt.adopt(url, storage_options=options)
    ledger = tmp_path / "run" / "lineage.sqlite"
    ledger.parent.mkdir()
    done = ckpt.adopt(url, ledger=ledger, storage_options=options)
    assert done.step == 9
    assert ckpt.verify_checkpoint(url, storage_options=options).ok
    [row] = ckpt.Ledger(ledger).rows()
    assert row.checkpoint == url
    assert adoption(row) is not None
    model, _ = _load_into_fresh(url, storage_options=options)
    for (name, a), b in zip(source.state_dict().items(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    with pytest.raises(CheckpointExistsError, match="under lineage already"):
        ckpt.adopt(url, ledger=ledger, storage_options=options)
    shutil.rmtree(local)


def test_the_default_ledger_is_a_training_runs_when_there_is_one(tmp_path: Path) -> None:
    run = tmp_path / "run"
    for step in (2, 3):
        _plain_save(run / "checkpoints" / f"step-{step}")
    with pytest.raises(ConfigurationError, match="no such directory"):
        ckpt.adopt(run / "checkpoints" / "step-2", ledger=tmp_path / "nowhere" / "lineage.sqlite")
    assert not (run / "checkpoints" / "step-2" / "manifest.json").exists()
    ckpt.adopt(run / "checkpoints" / "step-2", ledger=run)
    ckpt.adopt(run / "checkpoints" / "step-3")
    assert not (run / "checkpoints" / "lineage.sqlite").exists()
    assert [r.step for r in ckpt.Ledger(run / "lineage.sqlite").rows()] == [2, 3]
    assert ckpt.audit(ckpt.Ledger(run / "lineage.sqlite")).ok


def test_verify_of_a_plain_dcp_directory_points_at_adopt(plain: Path) -> None:
    report = ckpt.verify_checkpoint(plain)
    assert not report.ok
    assert "`shardline adopt` brings it under lineage" in str(report.error)
