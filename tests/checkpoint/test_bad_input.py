"""Bad input: clear errors on every rank, non-zero exits, nothing committed or overwritten."""

from __future__ import annotations

import hashlib
from pathlib import Path

from shardline import cli
from shardline.testing import run_distributed
from tests.checkpoint import ranks


def _tree_digest(path: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(path.rglob("*")):
        if f.is_file():
            h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()


def test_bad_inputs(saved_run: Path, tmp_path: Path) -> None:
    good = saved_run / "step-4"
    before = _tree_digest(good)
    results = run_distributed(ranks.bad_inputs, 2, args=(str(tmp_path), str(good)), timeout=60)
    same = set(results[0]) - {"unsafe_left_nothing", "plain_warning"}
    for key in same:  # every rank raises the same error type with the same message
        assert results[0][key] == results[1][key], (key, results[0][key], results[1][key])
    # rank 0's state cannot be saved; rank 1 learns it and raises the same error instead of waiting in the write
    assert "rank 0 could not stage" in results[1]["unsafe_state"][1]
    assert results[1]["plain_warning"] == ("warnings", "")  # the no-lineage warning is printed by rank 0 only
    out = results[0]
    kind, message = out["unwritable"]
    assert kind == "CheckpointError"
    assert "a-file" in message
    kind, message = out["exists"]
    assert kind == "CheckpointExistsError"
    assert "never overwrites" in message
    assert str(good) in message
    kind, message = out["unsafe_state"]
    assert kind == "ConfigurationError"
    assert "weights_only" in message
    assert "step-9" not in out["unsafe_left_nothing"][1]
    assert ".step-9" not in out["unsafe_left_nothing"][1]
    kind, message = out["not_a_checkpoint"]
    assert kind == "CheckpointNotFoundError"
    assert "not a checkpoint" in message
    kind, message = out["wrong_model"]
    assert kind == "CheckpointMismatchError"
    assert "blocks.2." in message
    kind, message = out["wrong_shapes"]
    assert kind == "CheckpointMismatchError"
    assert "blocks.0.fc1.weight: checkpoint shape (7, 10) vs model (9, 10)" in message
    assert out["resume_missing"][0] == "CheckpointNotFoundError"
    assert out["resume_empty"][0] == "CheckpointNotFoundError"
    assert "not a committed checkpoint" in out["resume_empty"][1]
    assert out["resume_auto_none"] == ("value", "None")
    assert "CheckpointWarning" in out["plain_warning"][1]
    assert "no lineage" in out["plain_warning"][1]
    for key in ("plain_full_verify", "plain_sizes_verify"):  # nothing in a plain DCP directory can be verified
        assert out[key][0] == "IntegrityError", out[key]
        assert "verify='none'" in out[key][1]
    assert out["old_level_name"][0] == "ConfigurationError"
    assert "now called 'sizes'" in out["old_level_name"][1]
    assert _tree_digest(good) == before  # the committed checkpoint was not touched


def test_cli_bad_input_exit_codes(saved_run: Path, tmp_path: Path, capsys) -> None:
    assert cli.main(["inspect", str(tmp_path)]) == 1
    assert "not a committed shardline checkpoint" in capsys.readouterr().err
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "x").write_text("keep me")
    assert cli.main(["consolidate", str(saved_run / "step-4"), str(occupied)]) == 1
    assert "already exists" in capsys.readouterr().err
    assert (occupied / "x").read_text() == "keep me"
    assert cli.main(["lineage", str(tmp_path)]) == 1
    assert "no lineage ledger" in capsys.readouterr().err
