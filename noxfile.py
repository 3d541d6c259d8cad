"""Sessions in their own virtual environments (``pip install nox``; ``nox -l`` lists them).

``nox -s gpu_rehearsal``: the GPU run of docs/gpu.md rehearsed on a CPU machine.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nox

ROOT = Path(__file__).parent


def _gpu_image_python() -> str:
    """A CPython 3.12, as the GPU image has: ``$GPU_REHEARSAL_PYTHON``, ``python3.12`` or pyenv's; else this one."""
    pyenv = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    candidates = [os.environ.get("GPU_REHEARSAL_PYTHON"), shutil.which("python3.12")]
    candidates += sorted(glob.glob(os.path.join(pyenv, "versions", "3.12*", "bin", "python")), reverse=True)
    for candidate in filter(None, candidates):
        probe = [candidate, "-c", "import sys; sys.exit(sys.version_info[:2] != (3, 12))"]
        if subprocess.run(probe, capture_output=True, check=False).returncode == 0:
            return candidate
    return sys.executable


GPU_IMAGE_LACKS = ("hydra", "omegaconf", "antlr4", "trl", "datasets", "s3fs")
"""What the GPU image does not have (docs/gpu.md): the rehearsal is void if any came in as a dependency."""


@nox.session(python=_gpu_image_python(), venv_backend="venv", reuse_venv=True)
def gpu_rehearsal(session: nox.Session) -> None:
    """The GPU run rehearsed on CPU: the image's packages, the prepared wheels, the kit up to "no CUDA device".

    1. An environment like the GPU image: Python 3.12 (if this machine has one), exactly the
       packages of ``benchmarks/gpu_image.txt`` (torch 2.11.0 and the rest, with their
       dependencies), none of ``GPU_IMAGE_LACKS``, and no shardline installed.
    2. ``gpu_wheels/`` as prepared by ``benchmarks/gpu_prepare.sh`` (run here first if missing;
       used as it is otherwise, so removing a wheel from it fails the rehearsal).
    3. ``benchmarks/gpu_check.sh`` with ``PIP_NO_INDEX=1``, no pip configuration and no
       ``PYTHONPATH``, as on the GPU machine: it must install the wheels, import the whole GPU path,
       collect tests/gpu, and only then exit 2 for want of a CUDA device.
    4. The kit's own tests and the trainer's host-sync tests in the same environment: the
       benchmarks' code and a trainer step run on CPU with only what the GPU machine will have.
    """
    started = time.monotonic()
    session.install("-r", str(ROOT / "benchmarks" / "gpu_image.txt"))
    python = str(Path(session.bin) / "python")
    session.run("python", "-c", "import sys, torch; print('Python', sys.version, 'torch', torch.__version__)")
    probe = "import importlib.util as u, sys; sys.exit(','.join(m for m in sys.argv[1:] if u.find_spec(m)) or None)"
    session.run("python", "-c", probe, *GPU_IMAGE_LACKS, silent=True)
    has_cuda = subprocess.run([python, "-c", "import torch; print(torch.cuda.is_available())"], capture_output=True)
    if has_cuda.stdout.strip() == b"True":
        session.skip("this machine has a CUDA device: run benchmarks/gpu_check.sh itself (docs/gpu.md)")
    if not (ROOT / "gpu_wheels").is_dir():
        session.run("bash", str(ROOT / "benchmarks" / "gpu_prepare.sh"), external=True)

    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k != "PYTHONPATH"}
    env.update(PATH=f"{session.bin}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(Path(session.bin).parent))
    env.update(PIP_NO_INDEX="1", PIP_CONFIG_FILE=os.devnull, PYTHON=python, OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as tmp:
        env["GPU_SITE"] = site = str(Path(tmp) / "site")
        kit = subprocess.run(
            ["bash", "benchmarks/gpu_check.sh", str(Path(tmp) / "out")],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False,
        )  # fmt: skip
        session.log(f"benchmarks/gpu_check.sh exited {kit.returncode}:\n{kit.stdout}{kit.stderr}")
        expected = ("gpu_check: environment ready", "gpu_check: no CUDA device", "tests collected")
        missing = [line for line in expected if line not in kit.stdout + kit.stderr]
        if kit.returncode != 2 or missing:
            session.error(f"the kit should reach its 'no CUDA device' exit (2) after its checks; got {kit.returncode}")
        report = [line.split() for line in kit.stdout.splitlines()]
        from_wheels = {words[0] for words in report if len(words) > 2 and words[2] == "gpu_wheels"}
        if from_wheels != {"hydra", "omegaconf", "antlr4"}:
            session.error(f"hydra, omegaconf and antlr4 must come from gpu_wheels/; from there: {from_wheels}")
        if (Path(tmp) / "out").exists():
            session.error("the kit wrote results without a device")
        session.run(
            "python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_gpu_kit.py",
            "tests/train/test_host_sync.py",
            env={**env, "PYTHONPATH": os.pathsep.join([site, str(ROOT / "src"), str(ROOT)])},
            include_outer_env=False,
        )  # fmt: skip
    session.log(f"gpu_rehearsal: passed in {time.monotonic() - started:.0f} s")
