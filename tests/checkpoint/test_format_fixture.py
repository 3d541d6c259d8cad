"""A checkpoint written by an earlier version (``tests/fixtures/checkpoint-v1``) verifies, loads at one and two ranks
to the values its writers held, passes ``shardline lineage`` and consolidates: the format did not move.

The fixture is committed (see ``format_fixture.py`` for how it was written); the tests work on a copy.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import shardline.checkpoint as ckpt
from shardline import cli
from shardline.checkpoint.integrity.manifest import read_manifest
from shardline.testing import run_distributed
from tests.checkpoint import format_fixture as fx
from tests.checkpoint.ranks import pack, unpack

# The manifest hash of the fixture's step-2: sha256 of its manifest.json, as the ledger records it.
MANIFEST_SHA256 = "00afd90f8fce8429a6fd689d2da82c86a0b98583e9c6c684f84230efe6ac7cd9"


@pytest.fixture
def run(tmp_path: Path) -> Path:
    copy = tmp_path / "checkpoint-v1"
    shutil.copytree(fx.FIXTURE, copy)
    return copy


def _expected() -> dict[str, torch.Tensor]:
    return load_file(str(fx.FIXTURE / fx.EXPECTED))


def load_auto(rank: int, world: int, directory: str) -> tuple[bytes | None, dict, str | None]:
    """Rank function: resume ``auto`` through a manager into a model of another seed; rank 0 returns its full state."""
    model, optimizer = fx.build(seed=7)
    with ckpt.CheckpointManager(directory) as manager:
        state = manager.load("auto", model=model, optimizer=optimizer)
        parent = manager.parent_manifest_hash
    taken = fx.full_state(model, optimizer)
    return (pack(taken) if rank == 0 else None), state, parent


def load_direct(rank: int, world: int, path: str) -> tuple[bytes | None, dict]:
    """Rank function: ``load`` the checkpoint against the fixture's manifest hash; rank 0 returns its full state."""
    model, optimizer = fx.build(seed=7)
    state = ckpt.load(path, model=model, optimizer=optimizer, expected_manifest_hash=MANIFEST_SHA256)
    taken = fx.full_state(model, optimizer)
    return (pack(taken) if rank == 0 else None), state


def _assert_equal(taken: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(taken) == sorted(expected)
    different = [k for k in expected if not torch.equal(taken[k], expected[k])]
    assert different == [], f"values differ from what the fixture's writers held: {different}"


def test_the_fixture_verifies_in_full(run: Path) -> None:
    report = ckpt.verify_checkpoint(run / "step-2", expected_manifest_hash=MANIFEST_SHA256)
    assert report.ok, report.to_json()
    assert report.manifest_hash == MANIFEST_SHA256
    assert report.files_checked == 7  # .metadata, a shard per rank, the statement, manifest.json and its two hash files
    assert read_manifest(run / "step-2")[1] == MANIFEST_SHA256


def test_the_fixture_loads_at_one_and_two_ranks_to_the_values_saved(run: Path) -> None:
    expected = _expected()
    taken, state = run_distributed(load_direct, 1, args=(str(run / "step-2"),), timeout=60)[0]
    _assert_equal(unpack(taken), expected)
    assert state == fx.TRAINER_STATE
    results = run_distributed(load_auto, 2, args=(str(run),), timeout=60)
    _assert_equal(unpack(results[0][0]), expected)
    assert [r[1] for r in results] == [fx.TRAINER_STATE, fx.TRAINER_STATE]
    assert [r[2] for r in results] == [MANIFEST_SHA256, MANIFEST_SHA256]  # the next save chains to it


def test_the_fixture_passes_lineage_and_consolidates(run: Path, tmp_path: Path) -> None:
    assert cli.main(["lineage", str(run)]) == 0
    rows = ckpt.Ledger(run / "lineage.sqlite").rows()
    assert [(r.step, r.checkpoint, r.manifest_sha256) for r in rows] == [(2, "step-2", MANIFEST_SHA256)]
    result = ckpt.consolidate(run / "step-2", tmp_path / "export.safetensors")
    assert result.source_manifest_hash == MANIFEST_SHA256
    exported = load_file(str(tmp_path / "export.safetensors"))
    expected = {k.removeprefix("model/"): v for k, v in _expected().items() if k.startswith("model/")}
    _assert_equal(exported, expected)
