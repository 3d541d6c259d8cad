"""``ShardlineTrainer`` with ``fp16=True``: shardline's loss scaler, whose overflow verdict every rank shares.

Two launches (tests/hf/fp16_script.py says what each runs): torchrun with 2 CPU ranks, and one
plain process on the same global batch. In every run an inf is written into the last rank's
gradient shard at step 1. The checks:

* the overflow is one rank's, the verdict everyone's: step 1 is skipped on both ranks (their
  shards unchanged), the scale backs off to the same value on both, and grows again in step;
  the control -- Accelerate's own ``torch.amp.GradScaler`` put back -- fails the same check;
* parity with one process: final weights within assert_close's fp16 defaults at each tensor's
  scale (:func:`tests.numerics.scale_ratio`). The runs use SGD, so two runs' weights differ by
  the learning rate times the difference of their gradients, and those are fp16 computations
  of the same sums in another order (the suite's rule for values computed in a narrow dtype);
  losses and grad norms likewise (:func:`close_ratio` at fp16). The same comparison sees a run
  that took the overflowed step and the control (:func:`assert_caught`);
* resume: the scale and growth counter are in the shardline checkpoint, so a run resumed from
  checkpoint-2 ends bit-identical to the uninterrupted one, with the same scale (a fresh scaler
  would have grown to 2048); a checkpoint without scaler state (a 32-bit run's) still loads and
  the scale starts fresh, logged.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("accelerate")

from shardline.distributed import free_port
from tests.numerics import assert_caught, assert_trajectory, close_ratio, scale_ratio

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "hf" / "fp16_script.py"
FP16 = torch.float16
INIT, BACKOFF = 2.0**10, 0.5  # fp16_script.POLICY

pytestmark = [pytest.mark.compat, pytest.mark.slow]


def _launch(cmd: list[str], out: Path, timeout: float) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=out, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]


@pytest.fixture(scope="module")
def torchrun_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fp16_torchrun")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(SCRIPT), "torchrun", str(out),
    ]  # fmt: skip
    _launch(cmd, out, timeout=150)
    return out


@pytest.fixture(scope="module")
def single_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fp16_single")
    _launch([sys.executable, str(SCRIPT), "single", str(out)], out, timeout=120)
    return out


def _ranks(out: Path, name: str) -> list[dict[str, Any]]:
    return [json.loads((out / f"{name}.rank{r}.json").read_text()) for r in range(2)]


def _weights(out: Path, name: str) -> dict[str, torch.Tensor]:
    return torch.load(out / f"{name}.weights.pt", weights_only=True)


def _log(out: Path, name: str) -> dict[str, Any]:
    return json.loads((out / f"{name}.log.json").read_text())


def _skip_problems(ranks: list[dict[str, Any]]) -> list[str]:
    """What is wrong with the W=2 run whose step 1 overflowed on rank 1 only."""
    problems = []
    for rank, said in enumerate(ranks):
        first, *rest = said["steps"]
        if not first["skipped"] or first["changed"]:
            problems.append(f"rank {rank} took step 1 (skipped: {first['skipped']}, changed: {first['changed']})")
        if first["scale"] != INIT * BACKOFF:
            problems.append(f"rank {rank} scale after step 1 is {first['scale']}, not backed off to {INIT * BACKOFF}")
        if any(s["skipped"] or not s["changed"] for s in rest):
            problems.append(f"rank {rank} skipped a clean step: {rest}")
        if not all(s["finite"] for s in said["steps"]):
            problems.append(f"rank {rank} has non-finite parameters")
    scales = [[s["scale"] for s in said["steps"]] for said in ranks]
    if scales[0] != scales[1]:
        problems.append(f"the ranks' scales part ways: {scales}")
    return problems


def test_overflow_on_one_rank_is_skipped_on_both_and_matches_one_process(torchrun_run: Path, single_run: Path) -> None:
    ranks = _ranks(torchrun_run, "fp16")
    assert [r["scaler_type"] for r in ranks] == ["TrainerGradScaler"] * 2
    assert _skip_problems(ranks) == []
    # Grows again after growth_interval=2 clean steps: 512 -> 1024 at step 3.
    assert [s["scale"] for s in ranks[0]["steps"]] == [512.0, 512.0, 1024.0, 1024.0]
    # The control: Accelerate's torch.amp.GradScaler decides per rank -- the same check fails.
    control = _ranks(torchrun_run, "fp16_torch")
    assert [r["scaler_type"] for r in control] == ["GradScaler"] * 2
    broken = _skip_problems(control)
    assert any("part ways" in p for p in broken), broken
    assert any(p.startswith("rank 0 scale after step 1 is 1024.0") for p in broken), broken
    # Parity with one process on the same global batch (step 1 skipped there too).
    one = json.loads((single_run / "fp16_single.rank0.json").read_text())["steps"]
    assert [s["skipped"] for s in one] == [True, False, False, False]
    assert [s["scale"] for s in one] == [512.0, 512.0, 1024.0, 1024.0]
    single, sharded = _weights(single_run, "fp16_single"), _weights(torchrun_run, "fp16")
    assert sharded.keys() == single.keys()
    assert_trajectory({k: scale_ratio(sharded[k], single[k], FP16) for k in single}, "fp16 W=2 vs W=1: weights")
    mine, ref = _log(torchrun_run, "fp16"), _log(single_run, "fp16_single")
    assert (mine["world_size"], ref["world_size"]) == (2, 1)
    pairs = {f"loss {i}": (a, b) for i, (a, b) in enumerate(zip(mine["loss"], ref["loss"], strict=True))}
    # Step 1's norm is inf on both sides (Trainer logs the norm of the overflowed gradients).
    assert mine["grad_norm"][0] == ref["grad_norm"][0] == float("inf")
    norms = zip(mine["grad_norm"][1:], ref["grad_norm"][1:], strict=True)
    pairs.update({f"grad norm {i + 2}": (a, b) for i, (a, b) in enumerate(norms)})
    assert_trajectory({k: close_ratio(a, b, FP16) for k, (a, b) in pairs.items()}, "fp16 W=2 vs W=1")
    # The same comparison sees a run that took the overflowed step, and the control.
    for name, out in (("fp16_single_stepped", single_run), ("fp16_torch", torchrun_run)):
        other = _weights(out, name)
        assert_caught({k: scale_ratio(other[k], single[k], FP16) for k in single}, None, f"{name} vs fp16_single")


def test_resume_restores_the_loss_scale(torchrun_run: Path) -> None:
    full, resumed = _weights(torchrun_run, "fp16"), _weights(torchrun_run, "fp16_resumed")
    assert resumed.keys() == full.keys()
    assert all(torch.equal(resumed[k], full[k]) for k in full)
    uninterrupted = _ranks(torchrun_run, "fp16")
    for rank, said in enumerate(_ranks(torchrun_run, "fp16_resumed")):
        # Restored at 512 with one clean step counted: grows at step 3, as without the interruption.
        # (A fresh scaler would start at 1024 and end at 2048.)
        assert said["steps"] == uninterrupted[rank]["steps"][2:], (rank, said["steps"])
        assert said["final_state"] == uninterrupted[rank]["final_state"] == {"scale": 1024.0, "growth_tracker": 1}
    assert not (torchrun_run / "fp16" / "checkpoint-2" / "scaler.pt").exists()  # in the shardline checkpoint


def test_checkpoint_without_scaler_state_loads_with_a_fresh_scale(single_run: Path) -> None:
    said = json.loads((single_run / "fp16_from_old.log.txt").read_text())
    assert said["step"] == 3
    assert said["scale"] == INIT
    expected = (
        f"{single_run / 'fp32_old' / 'checkpoint-2' / 'shardline'} holds no loss-scaler state (saved before fp16 "
        "runs recorded it, or by a run in another precision): the loss scale starts fresh at 1024.0"
    )
    assert expected in said["lines"], said["lines"]
