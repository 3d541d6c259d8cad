"""The GPU acceptance kit stays runnable on a machine without a GPU (docs/gpu.md).

``tests/gpu`` is collected here too (skipped without CUDA); this file checks the rest of the kit:
``benchmarks/gpu_check.sh`` says clearly that there is no CUDA device, and the benchmark's code
runs end to end on the CPU with a tiny shape, writing every field its results file promises.
"""

from __future__ import annotations

import json
import math
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

from shardline.testing import run_distributed

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--layers", "2", "--hidden", "32", "--intermediate", "64", "--heads", "4", "--kv-heads", "2"]
TINY += ["--vocab", "64", "--seq", "16", "--batch", "2", "--warmup", "1", "--steps", "1"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the script runs the kit itself")
def test_gpu_check_says_there_is_no_cuda_device() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run(
            ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), str(Path(tmp) / "out")],
            capture_output=True, text=True, timeout=60, cwd=ROOT,
        )  # fmt: skip
        assert not (Path(tmp) / "out").exists(), "nothing is written without a device"
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "gpu_check: no CUDA device: torch.cuda.is_available() is False" in proc.stderr
    assert "nothing was run" in proc.stderr


def _bench(rank: int, world_size: int, out: str) -> int:
    from benchmarks.gpu_bench import main

    return main(["--device", "cpu", "--out", out, *TINY])


def test_the_benchmark_runs_on_cpu_and_writes_its_results() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        assert run_distributed(_bench, 1, args=(str(out),), timeout=100) == [0]
        report = json.loads(out.read_text())
    assert {"device", "torch", "shardline", "shape", "parameters", "results", "targets"} <= set(report)
    assert list(report["results"]) == ["plain", "fsdp2", "shardline"]
    for config, result in report["results"].items():
        assert result["step_time_s"] > 0, config
        assert result["tokens_per_s"] == pytest.approx(2 * 16 / result["step_time_s"])
        assert result["parameters"] == report["parameters"]
        assert math.isfinite(result["final_loss"]), config
    assert list(report["targets"]) == [
        "step time <= FSDP2's",
        "peak memory <= FSDP2's",
        "overhead vs the plain model <= 3%",
    ]
    assert report["targets"]["peak memory <= FSDP2's"]["met"] is None, "no CUDA memory figures on the CPU"
