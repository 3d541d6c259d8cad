"""The GPU acceptance kit stays runnable on a machine without a GPU (docs/gpu.md).

``tests/gpu`` is collected here too (skipped without CUDA); this file checks the rest of the kit:
``benchmarks/gpu_check.sh`` checks its environment (the carried wheels, every import of the GPU
path, the collection of tests/gpu) before it says clearly that there is no CUDA device; the wheel
folder is checked against its list; everything the package needs is in the GPU image or the
wheels; and the benchmarks' code -- step times with a compiled column, async checkpoints and
verified loads against plain DCP -- runs end to end on the CPU with a tiny shape, writing every
field its results files promise. ``nox -s gpu_rehearsal`` runs this file again in an environment
like the GPU image.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from benchmarks import gpu_wheels

from shardline.testing import run_distributed

ROOT = Path(__file__).resolve().parents[1]
SHAPE = ["--layers", "2", "--hidden", "32", "--intermediate", "64", "--heads", "4", "--kv-heads", "2"]
SHAPE += ["--vocab", "64", "--seq", "16", "--batch", "2"]
TINY = [*SHAPE, "--warmup", "1", "--steps", "1"]
WHEEL_NAMES = (
    "antlr4_python3_runtime-4.9.3-py3-none-any.whl",
    "hydra_core-1.3.2-py3-none-any.whl",
    "omegaconf-2.3.0-py3-none-any.whl",
)


def _kit(tmp: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """``gpu_check.sh`` with this interpreter, installing into a site of its own under ``tmp``."""
    full = {**os.environ, "PYTHON": sys.executable, "GPU_SITE": str(tmp / "site"), "GPU_WHEELS": str(tmp / "none")}
    return subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), str(tmp / "out")],
        capture_output=True, text=True, timeout=100, cwd=ROOT, env={**full, **env},
    )  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the script runs the kit itself")
def test_gpu_check_checks_its_environment_then_says_there_is_no_cuda_device() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        proc = _kit(Path(tmp))
        assert not (Path(tmp) / "out").exists(), "nothing is written without a device"
    out = proc.stdout
    assert proc.returncode == 2, out + proc.stderr
    assert "gpu_check: no CUDA device: torch.cuda.is_available() is False" in proc.stderr
    assert "nothing was run" in proc.stderr
    # ... after the checks the GPU machine needs: the GPU path imported, tests/gpu collected.
    assert "gpu_preflight: the GPU path imports (14 modules) and the trainer's config compose" in out, out
    assert "5 tests collected" in out, out
    assert "gpu_check: environment ready" in out, out


def test_gpu_check_stops_when_a_wheel_is_missing() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        wheels = Path(tmp) / "wheels"
        wheels.mkdir()
        for name in WHEEL_NAMES[1:]:  # antlr4's wheel left out
            (wheels / name).write_bytes(b"")
        proc = _kit(Path(tmp), GPU_WHEELS=str(wheels))
        assert not (Path(tmp) / "out").exists()
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out
    assert "no wheel for antlr4-python3-runtime==4.9.*" in out
    assert "rerun benchmarks/gpu_prepare.sh" in out
    assert "gpu_check: the environment is incomplete" in proc.stderr
    assert "no CUDA device" not in out, "the environment is checked first"


def test_preflight_names_an_import_the_gpu_image_lacks() -> None:
    # The GPU image has no omegaconf of its own: the trainer (imported by tests/gpu) needs the carried wheel.
    code = "import sys; sys.modules['omegaconf'] = None; from benchmarks.gpu_preflight import main; sys.exit(main([]))"
    path = [str(ROOT / "src"), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100, cwd=ROOT, env=env)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "importing shardline.train failed" in proc.stderr
    assert "The GPU image lacks 'omegaconf'" in proc.stderr
    assert "benchmarks/gpu_wheels.txt" in proc.stderr


@pytest.mark.parametrize(
    ("files", "problem"),
    [
        (WHEEL_NAMES, None),
        (WHEEL_NAMES[:2], "no wheel for omegaconf<2.4,>=2.3"),
        ((*WHEEL_NAMES, "omegaconf-2.3.1-py3-none-any.whl"), "2 wheels for omegaconf"),
        ((*WHEEL_NAMES[:2], "omegaconf-2.4.0-py3-none-any.whl"), "version 2.4.0, outside omegaconf"),
        ((*WHEEL_NAMES, "PyYAML-6.0.2-cp312-cp312-manylinux_2_17_x86_64.whl"), "not in gpu_wheels.txt"),
        ((*WHEEL_NAMES[1:], "antlr4_python3_runtime-4.9.3-cp311-cp311-manylinux_2_17_x86_64.whl"), "cp311"),
        ((*WHEEL_NAMES[1:], "antlr4_python3_runtime-4.9.3-py3-none-macosx_11_0_arm64.whl"), "does not install"),
        ((), "has no wheels"),
    ],
)
def test_the_wheel_folder_is_checked_against_its_list(files: tuple[str, ...], problem: str | None) -> None:
    requirements = gpu_wheels.read_requirements()
    with tempfile.TemporaryDirectory() as tmp:
        for name in files:
            (Path(tmp) / name).write_bytes(b"")
        if problem is None:
            assert [w.path.name for w in gpu_wheels.check(Path(tmp), requirements)] == sorted(files)
        else:
            with pytest.raises(gpu_wheels.WheelsError, match=r"rerun benchmarks/gpu_prepare\.sh") as info:
                gpu_wheels.check(Path(tmp), requirements)
            assert problem in str(info.value)


def test_the_wheel_folder_must_fit_one_run() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for name in WHEEL_NAMES:
            (Path(tmp) / name).write_bytes(b"x" * 1024)
        with pytest.raises(gpu_wheels.WheelsError, match=r"over the 0 MiB one run carries"):
            gpu_wheels.check(Path(tmp), gpu_wheels.read_requirements(), limit_bytes=1024)


def test_every_dependency_is_in_the_gpu_image_or_its_wheels() -> None:
    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    declared = {canonicalize_name(r.name): r for r in map(Requirement, declared)}
    image = {canonicalize_name(r.name) for r in gpu_wheels.read_requirements(ROOT / "benchmarks" / "gpu_image.txt")}
    wheels = {canonicalize_name(r.name): r for r in gpu_wheels.read_requirements()}
    assert not set(declared) - image - set(wheels), "a dependency neither in the GPU image nor among its wheels"
    for name, req in wheels.items():  # the wheels are the versions the project accepts
        if name in declared:
            assert req.specifier == declared[name].specifier, (req, declared[name])
    assert not image & set(wheels), "a wheel would shadow the image's own package"


def _kit_on_cpu(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    """Both benchmarks on CPU with a tiny shape, in one launch; and what the trainer would compile."""
    from benchmarks import gpu_bench, gpu_checkpoint, gpu_offload

    from shardline.train.compiling import compile_units

    bench = gpu_bench.main(["--device", "cpu", "--out", f"{tmp}/bench.json", "--compile-backend", "aot_eager", *TINY])
    rounds = ["--rounds", "2", "--load-reps", "1", "--dir", tmp]
    checkpoint = gpu_checkpoint.main(["--device", "cpu", "--out", f"{tmp}/checkpoint.json", *rounds, *SHAPE])
    offload = gpu_offload.main(["--device", "cpu", "--out", f"{tmp}/offload.json", *SHAPE, "--steps", "2"])
    shape = gpu_bench.Shape(layers=2, hidden=32, intermediate=64, heads=4, kv_heads=2, vocab=64, seq=16, batch=2)
    model, _, _ = gpu_bench.build("shardline", shape, torch.device("cpu"))
    compiled = [m is layer for m, layer in zip(compile_units(model), model.model.layers, strict=True)]
    return {
        "bench": (bench, json.loads(Path(f"{tmp}/bench.json").read_text())),
        "checkpoint": (checkpoint, json.loads(Path(f"{tmp}/checkpoint.json").read_text())),
        "offload": (offload, json.loads(Path(f"{tmp}/offload.json").read_text())),
        "compiled_are_the_layers": compiled,
        "left_behind": sorted(p.name for p in Path(tmp).iterdir() if p.is_dir()),
    }


@pytest.fixture(scope="module")
def kit_on_cpu() -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        (res,) = run_distributed(_kit_on_cpu, 1, args=(tmp,), timeout=110)
    return res


def test_the_benchmark_runs_on_cpu_and_writes_its_results(kit_on_cpu: dict[str, Any]) -> None:
    code, report = kit_on_cpu["bench"]
    assert code == 0, report["failed"]
    assert {"device", "torch", "shardline", "shape", "parameters", "results", "failed", "targets"} <= set(report)
    assert list(report["results"]) == ["plain", "fsdp2", "shardline", "shardline+compile"]
    assert report["compile_backend"] == "aot_eager"
    for config, result in report["results"].items():
        assert result["step_time_s"] > 0, config
        assert result["first_step_s"] > 0, config
        assert result["tokens_per_s"] == pytest.approx(2 * 16 / result["step_time_s"])
        assert result["parameters"] == report["parameters"]
        assert math.isfinite(result["final_loss"]), config
    assert list(report["targets"]) == [
        "step time <= FSDP2's",
        "peak memory <= FSDP2's",
        "overhead vs the plain model <= 3%",
        "compiled step time <= eager's",
    ]
    assert report["targets"]["peak memory <= FSDP2's"]["met"] is None, "no CUDA memory figures on the CPU"
    assert report["targets"]["compiled step time <= eager's"]["speedup"] > 0
    # the compiled column compiles what trainer.compile=true compiles: each decoder layer, and nothing else
    assert kit_on_cpu["compiled_are_the_layers"] == [True, True]


def test_the_checkpoint_benchmark_runs_on_cpu_and_writes_its_results(kit_on_cpu: dict[str, Any]) -> None:
    code, report = kit_on_cpu["checkpoint"]
    assert {"device", "state_bytes", "checkpoint_bytes", "async_save", "load", "failed", "targets"} <= set(report)
    ours = report["async_save"]["shardline"]
    assert len(ours["blocking_s"]) == len(ours["total_s"]) == 2, "two rounds"
    assert all(0 < b <= t for b, t in zip(ours["blocking_s"], ours["total_s"], strict=True))
    assert report["checkpoint_bytes"] >= report["state_bytes"]
    assert len(report["load"]["plain_dcp"]) == len(report["load"]["shardline_verified"]) == 1
    # On CPU, DCP cannot stage shardline's DTensors (views of one flat buffer: torch's deepcopy of a DTensor
    # with a storage offset fails, 2.11 to 2.13): recorded as a failure, the rest still measured.
    assert set(report["failed"]) <= {"dcp"}, report["failed"]
    assert set(report["async_save"]) | set(report["failed"]) == {"shardline", "dcp"}
    assert code == (1 if report["failed"] else 0)
    verdict = report["targets"]["verified load <= 1.3x plain DCP load (page cache)"]
    assert verdict["ratio"] > 0
    assert verdict["met"] == (verdict["ratio"] <= 1.3)
    assert "async save blocks <= DCP async_save's" in report["targets"]
    assert kit_on_cpu["left_behind"] == [], "the checkpoints are deleted"


def test_the_offload_benchmark_runs_on_cpu_and_writes_its_results(kit_on_cpu: dict[str, Any]) -> None:
    code, report = kit_on_cpu["offload"]
    assert code == 0, report["failed"]
    plain, offload = report["results"]["shardline"], report["results"]["shardline+offload"]
    assert plain["host_mib"] == 0
    assert plain["host_to_device_mib_per_step"] == 0
    assert offload["host_mib"] > 0, "shards, gradients and AdamW state are counted on the host"
    assert offload["host_to_device_mib_per_step"] > 0
    assert offload["device_to_host_mib_per_step"] > 0
    assert offload["step_time_s"] > 0
    assert offload["host_pinned"] is False, "page-locked host memory only where the device is CUDA"
    assert plain["host_pinned"] is None
    verdicts = report["verdicts"]
    assert verdicts["max_loss_difference"] == 0, "on CPU offload changes nothing, bit for bit"
    assert verdicts["target"]["met"] is None, "no CUDA memory figures on the CPU"
