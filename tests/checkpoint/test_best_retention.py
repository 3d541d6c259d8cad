"""Best-k retention (``keep_best_k``, ``monitor``, ``mode``): the k best by a recorded metric plus the newest stay,
every other regular checkpoint goes behind a tombstone row, in a directory and in a bucket, across restarts;
``shardline lineage`` marks the ones kept as best with their values."""

from __future__ import annotations

import json
import math
import uuid
from pathlib import Path

import pytest
import torch

import shardline.checkpoint as ckpt
from shardline import cli
from shardline.checkpoint.provenance.best import BestPolicy, rank_best
from shardline.checkpoint.provenance.directory import scan
from shardline.checkpoint.storage.objects import as_location
from shardline.errors import ConfigurationError
from tests.checkpoint.conftest import S3_BUCKET
from tests.checkpoint.seaweed import S3Server

pytestmark = pytest.mark.timeout(120)


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _save(manager: ckpt.CheckpointManager, model, opt, step: int, val_loss: float | None) -> None:
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    opt.zero_grad()
    metrics = {"loss": 9.0} if val_loss is None else {"val_loss": val_loss, "loss": 9.0}
    manager.save(ckpt.SaveRequest(step=step, model=model, optimizer=opt, metrics=metrics))


def _kept(directory) -> list[int]:
    return [c.step for c in scan(directory)[0]]


def _tombstones(ledger: ckpt.Ledger) -> dict[int, dict]:
    return {r.step: json.loads(r.detail) for r in ledger.rows() if r.event == "tombstone"}


def test_rank_best_orders_by_value_then_newer_step_and_never_ranks_a_missing_value() -> None:
    entries = [("a", 1, 2.0), ("b", 2, None), ("c", 3, 1.0), ("d", 4, 2.0), ("e", 5, math.nan), ("f", 6, 3.0)]
    low = rank_best(entries, BestPolicy(keep_best_k=3, monitor="val_loss", mode="min"))
    assert {k: r.place for k, r in low.items()} == {"c": 1, "d": 2, "a": 3}, "a tie goes to the newer step"
    high = rank_best(entries, BestPolicy(keep_best_k=2, monitor="acc", mode="max"))
    assert {k: r.place for k, r in high.items()} == {"f": 1, "d": 2}
    every = rank_best(entries, BestPolicy(keep_best_k=10, monitor="val_loss"))
    assert set(every) == {"a", "c", "d", "f"}, "no value (None) and NaN are never kept as best"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"keep_best_k": -1, "monitor": "val_loss"}, "keep_best_k must be a non-negative integer"),
        ({"keep_best_k": 2, "monitor": "val_loss", "mode": "lowest"}, "mode must be 'min'"),
        ({"keep_best_k": 2}, "needs checkpoint.monitor"),
    ],
)
def test_bad_best_k_settings_are_refused_when_the_manager_is_made(tmp_path: Path, kwargs, match) -> None:
    with pytest.raises(ConfigurationError, match=match):
        ckpt.CheckpointManager(tmp_path / "checkpoints", **kwargs)
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())


def test_keep_best_k_in_a_directory_keeps_the_best_and_the_newest_across_a_restart(tmp_path: Path, capsys) -> None:
    directory = tmp_path / "checkpoints"
    model, opt = _model()
    manager = ckpt.CheckpointManager(directory, keep_best_k=2, monitor="val_loss", mode="min")
    # step 3 has no val_loss (saved without an evaluation): never kept as best, however the others rank
    for step, value in [(1, 5.0), (2, 1.0), (3, None), (4, 2.0), (5, 2.0), (6, 4.0)]:
        _save(manager, model, opt, step, value)
    # best two: step-2 (1.0) and step-5 (2.0, the newer of the tie with step-4); plus the newest, step-6
    assert _kept(directory) == [2, 5, 6]
    ledger = ckpt.Ledger(directory / "lineage.sqlite")
    buried = _tombstones(ledger)
    assert sorted(buried) == [1, 3, 4]
    for detail in buried.values():
        assert detail["keep_best_k"] == 2
        assert "keep_best_k=2 (val_loss, min)" in detail["reason"]
        assert detail["files"] >= 2
    commit = next(r for r in ledger.rows() if r.is_commit and r.step == 2)
    assert json.loads(commit.detail)["metrics"] == {"loss": "9.0", "val_loss": "1.0"}

    # a restart: a new manager ranks by the values the ledger recorded, not by anything it holds in memory
    model, opt = _model()
    manager = ckpt.CheckpointManager(directory, keep_best_k=2, monitor="val_loss", mode="min")
    _save(manager, model, opt, 7, 1.5)
    assert _kept(directory) == [2, 7], "step-7 (1.5) is second best and the newest; step-5 and step-6 go"
    assert sorted(_tombstones(ledger)) == [1, 3, 4, 5, 6]
    assert ckpt.audit(ledger).ok

    assert cli.main(["lineage", str(directory)]) == 0
    out = capsys.readouterr().out
    marked = {line.split("step")[1].split()[0]: line for line in out.splitlines() if "kept as best" in line}
    assert set(marked) == {"2", "7"}
    assert "kept as best #1 of 2: val_loss=1)" in marked["2"]
    assert "kept as best #2 of 2: val_loss=1.5)" in marked["7"]
    assert cli.main(["lineage", str(directory), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    best = {r["step"]: r["kept_as_best"] for r in rows if "kept_as_best" in r}
    assert best == {
        2: {"place": 1, "monitor": "val_loss", "value": 1.0},
        7: {"place": 2, "monitor": "val_loss", "value": 1.5},
    }


@pytest.mark.parametrize("async_save", [False, True])
def test_keep_last_n_and_keep_best_k_keep_the_union(tmp_path: Path, async_save: bool) -> None:
    directory = tmp_path / "checkpoints"
    model, opt = _model()
    manager = ckpt.CheckpointManager(
        directory, keep_last_n=2, keep_best_k=1, monitor="val_loss", mode="max", async_save=async_save
    )
    for step, value in [(1, 0.1), (2, 0.9), (3, 0.2), (4, 0.3), (5, 0.4)]:
        _save(manager, model, opt, step, value)
    manager.close()
    assert _kept(directory) == [2, 4, 5], "the best (max: step-2) and the newest two"
    rows = [r for r in ckpt.Ledger(directory / "lineage.sqlite").rows() if r.is_commit]
    assert [json.loads(r.detail)["metrics"]["val_loss"] for r in rows] == ["0.1", "0.9", "0.2", "0.3", "0.4"]


def test_keep_best_k_in_a_bucket(s3_env: S3Server, tmp_path: Path, capsys) -> None:
    root, ledger_path = f"s3://{S3_BUCKET}/{uuid.uuid4().hex[:12]}", tmp_path / "lineage.sqlite"
    model, opt = _model()
    manager = ckpt.CheckpointManager(root, ledger_path=ledger_path, keep_best_k=1, monitor="val_loss")
    for step, value in [(1, 3.0), (2, 1.0), (3, 2.0), (4, 2.5)]:
        _save(manager, model, opt, step, value)
    assert _kept(as_location(root)) == [2, 4]
    names = sorted(p.rsplit("/", 1)[-1] for p in s3_env.filesystem().ls(root.removeprefix("s3://")))
    assert names == ["step-2", "step-4"], "nothing left of the deleted ones under the prefix"
    ledger = ckpt.Ledger(ledger_path)
    assert sorted(_tombstones(ledger)) == [1, 3]
    assert cli.main(["lineage", str(tmp_path)]) == 0
    assert "kept as best #1 of 1: val_loss=1)" in capsys.readouterr().out
