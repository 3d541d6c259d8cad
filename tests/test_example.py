"""The example script trains under torchrun with 2 CPU ranks and its loss goes down."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_example_trains_under_torchrun() -> None:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(ROOT / "examples" / "train_fully_shard.py"), "--steps", "21",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=100, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", proc.stdout)]
    assert len(losses) == 3, proc.stdout
    assert losses[-1] < 0.5 * losses[0], losses
    assert "collectives per step: {'all_gather': '8', 'reduce_scatter': '5', 'all_reduce': '1'}" in proc.stdout


def test_readme_quickstart_has_two_commands_and_ci_runs_the_second() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(?:bash|sh)\n(.*?)```", section, flags=re.S)
    commands = [line for block in blocks for line in block.splitlines() if line.strip() and not line.startswith("#")]
    assert len(commands) == 2, commands
    assert commands[1] in (ROOT / ".ci" / "run").read_text()


def test_lightning_example_launches_its_own_processes(tmp_path: Path) -> None:
    """Lightning starts rank 1 itself (no torchrun); the strategy joins the processes and checkpoints verify."""
    pytest.importorskip("lightning")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(ROOT / "examples" / "lightning_shardline.py"), "--devices", "2", "--epochs", "1"]
    proc = subprocess.run(
        [*cmd, "--out", str(tmp_path)], capture_output=True, text=True, timeout=110, cwd=tmp_path, env=env
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "final loss" in proc.stdout
    (step,) = (tmp_path / "checkpoints").glob("*.ckpt")
    assert json.loads((step / "manifest.json").read_text())["world_size"] == 2
    lineage = subprocess.run(
        [sys.executable, "-m", "shardline.cli", "lineage", str(tmp_path / "checkpoints")],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert lineage.returncode == 0, lineage.stdout + lineage.stderr


def test_torchtitan_style_example_saves_and_resumes_through_dcp(tmp_path: Path) -> None:
    """The checkpointer calls dcp.save/dcp.load itself with shardline's Writer/Reader: lineage verifies."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(ROOT / "examples" / "torchtitan_style_checkpoint.py"), "--out", str(tmp_path),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=100, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "resumed at step 4; parameters equal: True" in proc.stdout, proc.stdout
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*")) == ["step-2", "step-4"]
    lineage = subprocess.run(
        [sys.executable, "-m", "shardline.cli", "lineage", str(tmp_path / "checkpoints")],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert lineage.returncode == 0, lineage.stdout + lineage.stderr
    assert "2 committed checkpoint(s)" in lineage.stdout
