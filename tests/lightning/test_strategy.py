"""``shardline.lightning.ShardlineStrategy`` under ``lightning.Trainer`` on 2 CPU processes, against one-process torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardline.testing import run_distributed
from tests.checkpoint.ranks import unpack
from tests.lightning import ranks
from tests.lightning.reference import CLIP, train_reference
from tests.numerics import assert_caught, assert_trajectory, close_ratio, trajectory_ratio
from tests.train.test_cli import PYTHONPATH

pytest.importorskip("lightning")
pytestmark = [pytest.mark.numerics, pytest.mark.compat]  # run again under another CPU kernel set by .ci/run


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("lightning")
    two = run_distributed(ranks.train_save_resume, 2, args=(str(root),), timeout=110)
    one = run_distributed(ranks.resume_alone, 1, args=(str(root / "w1"), two[0]["first"]), timeout=100)
    return {"root": root, "two": two, "one": one[0]}


def _diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_two_processes_equal_one_process_with_clipping(runs: dict) -> None:
    reference, ref_norms = train_reference(epochs=2, clip=CLIP)
    unclipped, _ = train_reference(epochs=2, clip=None)
    rank0 = runs["two"][0]
    weights = unpack(rank0["straight"])
    assert_trajectory(trajectory_ratio(weights, reference), "Lightning, 2 ranks vs one process: weights")
    # Clipping moves the weights far beyond that tolerance, so the comparison can see it.
    assert max(trajectory_ratio(unclipped, reference).values()) > 100, "clipping must change the result"
    # The logged norm is the global one (every step, before clipping), and it was above the clip value.
    assert len(rank0["straight_norms"]) == 8
    ratios = {
        f"step {i}": close_ratio(a, b) for i, (a, b) in enumerate(zip(rank0["straight_norms"], ref_norms, strict=True))
    }
    assert_trajectory(ratios, "Lightning, 2 ranks vs one process: logged gradient norms")
    for fault, res in rank0["faulted"].items():
        seen = {f"step {i}": close_ratio(a, b) for i, (a, b) in enumerate(zip(res["norms"], ref_norms, strict=True))}
        seen.update(trajectory_ratio(unpack(res["weights"]), reference))
        assert_caught(seen, None, f"Lightning with {fault}")
    assert max(ref_norms) > CLIP
    assert runs["two"][1]["straight_norms"] == rank0["straight_norms"], "every rank logs the same global norm"


def test_save_then_resume_continues_bit_identically(runs: dict) -> None:
    rank0 = runs["two"][0]
    straight, resumed = unpack(rank0["straight"]), unpack(rank0["resumed"])
    for key in straight:
        assert torch.equal(straight[key], resumed[key]), key
    assert rank0["resumed_global_step"] == 8
    assert rank0["resumed_norms"] == rank0["straight_norms"][4:], "the resumed epoch repeats the straight one"
    # Lightning's checkpoints are shardline checkpoints: verified, chained and recorded in the ledger.
    root = runs["root"]
    first = Path(rank0["first"])
    assert first.name == "epoch=0-step=4.ckpt"
    assert first.is_dir()
    manifest = json.loads((first / "manifest.json").read_text())
    assert manifest["world_size"] == 2
    assert manifest["contents"]["optimizer"] is True
    cli = [sys.executable, "-m", "shardline.cli"]
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    verify = subprocess.run([*cli, "verify", str(first)], capture_output=True, text=True, timeout=60, env=env)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    lineage = subprocess.run(
        [*cli, "lineage", str(root / "ckpts"), "--json"], capture_output=True, text=True, timeout=60
    )
    assert lineage.returncode == 0, lineage.stdout + lineage.stderr
    rows = json.loads(lineage.stdout)["rows"]
    assert [(r["step"], r["checkpoint"]) for r in rows] == [(4, "epoch=0-step=4.ckpt"), (8, "epoch=1-step=8.ckpt")]
    assert rows[1]["parent_manifest_sha256"] == rows[0]["manifest_sha256"]
    resumed = json.loads((root / "resumed" / "epoch=1-step=8.ckpt" / "manifest.json").read_text())
    assert resumed["parent_manifest_sha256"] == rows[0]["manifest_sha256"], "the resumed run descends from epoch 0"


def test_an_unreadable_manifest_fails_every_rank_with_rank0s_error(runs: dict) -> None:
    seen = [rank["unreadable_manifest"] for rank in runs["two"]]
    assert seen[0].startswith("IntegrityError: "), seen[0]
    assert "manifest.json" in seen[0], seen[0]
    assert seen[1] == seen[0], "rank 1 raises rank 0's error (it read no manifest itself)"


def test_resume_at_one_process(runs: dict) -> None:
    one = runs["one"]
    assert one["global_step"] == 8
    weights = unpack(one["weights"])
    straight = unpack(runs["two"][0]["straight"])
    assert_trajectory(trajectory_ratio(weights, straight), "model and optimizer state resharded from 2 ranks to 1")
    at_checkpoint, _ = train_reference(epochs=1, clip=CLIP)
    assert _diff(weights, at_checkpoint) > 1e-3, "it trained on from the checkpoint"
