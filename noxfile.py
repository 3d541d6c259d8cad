"""nox sessions (``pip install -e ".[dev]"`` installs nox; nox itself runs on Python 3.11 or later).

``nox -s compat`` runs the whole version matrix (:func:`compat`): every session of compat, each in its
own virtual environment under ``.nox/``, installs shardline from this checkout with one set of
library versions and runs the compatibility subset (``pytest -m compat``: the tests that touch
every place that depends on a library's version). ``nox -s "compat(torch-2.11)"`` runs one;
``nox -l`` lists them. The last results are in docs/testing.md. The floors are read from
pyproject.toml, so the versions a floor session installs are the ones the project declares:
raising a floor there raises it here.

``nox -s gpu_rehearsal``: the GPU run of docs/gpu.md rehearsed on a CPU machine (:func:`gpu_rehearsal`).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nox
import tomllib
from packaging.requirements import Requirement
from packaging.version import Version

nox.options.default_venv_backend = "venv"

ROOT = Path(__file__).parent


# ---------------------------------------------------------------- the version matrix: nox -s compat

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _floors() -> dict[str, str]:
    """The lowest version pyproject.toml declares for each dependency named with ``>=``."""
    declared = list(PYPROJECT["project"]["dependencies"])
    for extra in PYPROJECT["project"]["optional-dependencies"].values():
        declared += extra
    floors: dict[str, str] = {}
    for line in declared:
        req = Requirement(line)
        for spec in req.specifier:
            if spec.operator == ">=":
                floors.setdefault(req.name, spec.version)
    return floors


FLOORS = _floors()
LIBRARIES = ("transformers", "trl", "peft", "accelerate", "datasets", "lightning")
"""The libraries whose private or recently changed APIs shardline uses (besides torch)."""
LIBRARY_FLOORS = {name: FLOORS[name] for name in LIBRARIES}

NEWEST = {
    "transformers": "5.24.0",
    "trl": "1.16.0",
    "peft": "0.21.2",
    "accelerate": "1.15.0",
    "datasets": "5.2.0",
    "lightning": "2.6.6",
}
"""The newest release of each library on the package index (checked 2026-11-27). Every torch session runs these."""

PYTHON_FLOOR = PYPROJECT["project"]["requires-python"].removeprefix(">=")
"""The oldest Python pyproject.toml allows (its interpreter must be on PATH as ``python3.10``)."""

TORCH_DEFAULT = "2.13.0"
"""The torch of the README's install line and CI (a CPU build on the development machines)."""

TORCH_NEWEST = "2.14.1"
"""The newest torch installable on the development machines: their pip configuration caps torch at 2.14.1
(2.15.0 is on the index and has not been run)."""

TORCH_RELEASES = sorted({Version(v) for v in (FLOORS["torch"], "2.11.0", TORCH_DEFAULT, TORCH_NEWEST)})
"""The torch releases run: the floor pyproject.toml declares, 2.11, the default and the newest installable."""

MATRIX: dict[str, tuple[str, dict[str, str]]] = {
    # id: (Python, exact versions). One session per torch release, with the newest libraries...
    **{f"torch-{str(v).removesuffix('.0')}": ("3.11", {"torch": str(v), **NEWEST}) for v in TORCH_RELEASES},
    # ...and one with every library at its floor, on the default torch.
    "libraries-floor": ("3.11", {"torch": TORCH_DEFAULT, **LIBRARY_FLOORS}),
    # ...and every floor together on the oldest Python pyproject.toml allows.
    f"floors-py{PYTHON_FLOOR}": (
        PYTHON_FLOOR,
        {"torch": FLOORS["torch"], **LIBRARY_FLOORS},
    ),
}
"""Each session of the matrix: the Python it runs on and the versions it installs."""

# Run inside each session's environment: the versions installed must be the ones asked for.
_CHECK_VERSIONS = """
import json, sys
from importlib.metadata import version
from packaging.version import Version

wanted = json.loads(sys.argv[1])
print(f"python {sys.version.split()[0]}")
wrong = []
for name, asked in wanted.items():
    got = version(name)
    print(f"{name} {got}")
    if Version(Version(got).public) != Version(asked):  # 2.13.0+cpu is 2.13.0; 2.11 is 2.11.0
        wrong.append(f"{name}: asked for {asked}, installed {got}")
import torch, transformers
print(f"torch.__version__ {torch.__version__}, transformers.__version__ {transformers.__version__}")
if wrong:
    sys.exit("the session did not install what it asked for:\\n  " + "\\n  ".join(wrong))
"""


@nox.session
@nox.parametrize(
    ("python", "versions"),
    [nox.param(python, versions, id=name) for name, (python, versions) in MATRIX.items()],
)
def compat(session: nox.Session, versions: dict[str, str]) -> None:
    """The compatibility subset (``pytest -m compat``) with one set of library versions."""
    pins = [f"{name}=={version}" for name, version in versions.items()]
    session.install(*pins, "-e", ".[test]")
    session.run("python", "-c", _CHECK_VERSIONS, json.dumps(versions))
    session.run(
        "python", "-m", "pytest", "-m", "compat", "-p", "no:cacheprovider", *session.posargs,
        env={"OMP_NUM_THREADS": "1"},
    )  # fmt: skip


# ---------------------------------------------------------------- the GPU rehearsal: nox -s gpu_rehearsal


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
