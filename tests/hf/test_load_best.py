"""``load_best_model_at_end`` on ``ShardlineTrainer`` (W=1): the model at the end holds the best checkpoint's
weights, loaded from its verified shardline checkpoint; Trainer's rotation around it is in the ledger."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from shardline import cli
from tests.hf.test_trainer import ROOT, _launch

pytestmark = pytest.mark.compat


def test_load_best_model_at_end_loads_the_best_checkpoints_weights(tmp_path: Path, capsys) -> None:
    _launch([sys.executable, str(ROOT / "tests" / "hf" / "best_script.py"), str(tmp_path)], tmp_path, timeout=110)
    result = json.loads((tmp_path / "best.json").read_text())
    assert result["saved"] == [2, 4, 6]
    losses = result["eval_loss"]
    assert result["best_step"] == max((2, 4, 6), key=lambda s: losses[str(s)]), losses
    assert result["best_step"] != 6, f"the setup must make an early checkpoint the best: {losses}"
    assert result["equals_best"], "the model at the end is not the best checkpoint's"
    assert not result["equals_last"]
    assert result["kept"] == [f"checkpoint-{result['best_step']}"], "save_total_limit=1 keeps only the best"
    assert cli.main(["lineage", str(tmp_path / "best")]) == 0, "every checkpoint Trainer deleted has its tombstone"
    capsys.readouterr()
