"""Lineage for Lightning's own FSDPStrategy and ModelParallelStrategy at W=2 on CPU, against their own checkpoints.

One launch: per strategy, Lightning's own checkpoint and resume; the same with the lineage subclass (one change to
``Trainer(strategy=...)``); a lineage checkpoint resumed by Lightning's own strategy; a resume from a copy with a
flipped byte; a resume from a checkpoint of Lightning's own strategy.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lightning")

import shardline.checkpoint as ckpt
from shardline.checkpoint.provenance.ledger import LEDGER_NAME
from shardline.errors import ConfigurationError
from shardline.testing import run_distributed
from tests.checkpoint.ranks import unpack
from tests.lightning import lineage_ranks

pytestmark = pytest.mark.slow
KINDS = lineage_ranks.KINDS


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict[str, Any]]]:
    root = tmp_path_factory.mktemp("lightning_lineage")
    return run_distributed(lineage_ranks.both_kinds, 2, args=(str(root),), timeout=110)


def _same(a: bytes, b: bytes) -> bool:
    x, y = unpack(a), unpack(b)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.mark.parametrize("kind", KINDS)
def test_resume_equals_the_frameworks_own_resume(runs: list[dict[str, dict[str, Any]]], kind: str) -> None:
    """Each rank's shards after resuming a lineage checkpoint are those after resuming Lightning's own checkpoint,
    and those of the uninterrupted run; Lightning's own strategy resumes the lineage checkpoint alike."""
    for rank_result in runs:
        r = rank_result[kind]
        assert _same(r["resumed"], r["own_resumed"])
        assert _same(r["straight"], r["own_resumed"])
        assert _same(r["by_own"], r["own_resumed"])
        assert not _same(r["fresh"], r["own_resumed"])  # the resumed model starts elsewhere: the load is what matters
        assert r["resumed_global_step"] == 8


@pytest.mark.parametrize("kind", KINDS)
def test_checkpoints_verify_in_lightnings_layout_and_chain_in_the_ledger(
    runs: list[dict[str, dict[str, Any]]], kind: str
) -> None:
    r = runs[0][kind]
    first, second = (Path(p) for p in r["saved"])
    for path in (first, second):
        report = ckpt.verify_checkpoint(path, level="full")
        assert report.ok, report
        names = {p.name for p in path.iterdir()}
        assert {".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt", "manifest.json"} <= names
        listed = {f["path"] for f in json.loads((path / "manifest.json").read_text())["files"]}
        assert "meta.pt" in listed  # Lightning's own file is hashed and committed with the shards
    rows = [row for row in ckpt.Ledger(first.parent / LEDGER_NAME).rows() if row.is_commit]
    assert [(row.checkpoint, row.step, row.world_size) for row in rows] == [(first.name, 4, 2), (second.name, 8, 2)]
    assert rows[1].parent_manifest_sha256 == rows[0].manifest_sha256
    # The resumed run saved every 2 steps and kept one (save_top_k=1): its first save descends from the checkpoint
    # it resumed, and the pruned one left a tombstone row, so the ledger still verifies.
    resumed_ledger = ckpt.Ledger(Path(r["resumed_saves"][0]).parent / LEDGER_NAME)
    assert [Path(p).name for p in r["resumed_saves"]] == ["epoch=1-step=8.ckpt"]
    resumed_rows = resumed_ledger.rows()
    commits = [row for row in resumed_rows if row.is_commit]
    assert [row.step for row in commits] == [6, 8]
    assert commits[0].parent_manifest_sha256 == rows[0].manifest_sha256
    assert commits[1].parent_manifest_sha256 == commits[0].manifest_sha256
    assert [row.checkpoint for row in resumed_rows if not row.is_commit] == [commits[0].checkpoint]
    assert not resumed_ledger.verify(check_checkpoints=True).problems


@pytest.mark.parametrize("kind", KINDS)
def test_each_checkpoint_and_the_run_tags_are_recorded_in_the_mlflow_logger(
    runs: list[dict[str, dict[str, Any]]], kind: str, tmp_path: Path
) -> None:
    pytest.importorskip("mlflow")
    from tests.diagnostics.test_frontend_callbacks import assert_checkpoints_in_mlflow

    first, second = (Path(p) for p in runs[0][kind]["saved"])
    checkpoints = {p.name.replace("=", "_"): p for p in (first, second)}
    db = first.parent.parent / "mlflow.db"
    assert_checkpoints_in_mlflow(db, None, kind, f"LIN-{kind}", checkpoints, tmp_path)


@pytest.mark.parametrize("kind", KINDS)
def test_a_flipped_byte_is_refused_on_every_rank_before_anything_is_loaded(
    runs: list[dict[str, dict[str, Any]]], kind: str
) -> None:
    for rank_result in runs:
        r = rank_result[kind]
        damaged = r["damaged"]
        assert damaged["error"].startswith("IntegrityError"), damaged["error"]
        assert f"{r['victim']}: altered" in damaged["error"]
        assert "must not be loaded" in damaged["error"]
        assert _same(damaged["weights"], r["fresh"])  # the model kept its own weights
        assert damaged["global_step"] == 0


@pytest.mark.parametrize("kind", KINDS)
def test_a_checkpoint_without_lineage_is_refused_with_the_way_to_adopt_it(
    runs: list[dict[str, dict[str, Any]]], kind: str
) -> None:
    for rank_result in runs:
        error = rank_result[kind]["unadopted"]
        assert error.startswith("IntegrityError"), error
        assert "without a shardline manifest" in error
        assert "shardline adopt" in error


def test_full_checkpoints_are_refused() -> None:
    from shardline.lightning import LineageFSDPStrategy, LineageModelParallelStrategy

    with pytest.raises(ConfigurationError, match="state_dict_type='full'"):
        LineageFSDPStrategy(state_dict_type="full")
    with pytest.raises(ConfigurationError, match="save_distributed_checkpoint=False"):
        LineageModelParallelStrategy(save_distributed_checkpoint=False)
    with pytest.raises(ConfigurationError):
        LineageFSDPStrategy(verify="most")
    assert LineageFSDPStrategy()._state_dict_type == "sharded"  # FSDPStrategy's default is "full"
