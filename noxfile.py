"""nox sessions (``pip install -e ".[dev]"`` installs nox; nox itself runs on Python 3.11 or later).

The version matrix (:func:`compat`) runs shardline against other versions of the libraries it
depends on.

``nox -s compat`` runs the whole version matrix: every session of compat, each in its own virtual
environment under ``.nox/``, installs shardline from this checkout with one set of library
versions and runs the compatibility subset (``pytest -m compat``: the tests that touch every
place that depends on a library's version). ``nox -s "compat(torch-2.11)"`` runs one;
``nox -l`` lists them. The last results are in docs/testing.md.

The floors are read from pyproject.toml, so the versions a floor session installs are the ones
the project declares: raising a floor there raises it here.
"""

from __future__ import annotations

import json
from pathlib import Path

import nox
import tomllib
from packaging.requirements import Requirement
from packaging.version import Version

nox.options.default_venv_backend = "venv"

# ---------------------------------------------------------------- the version matrix: nox -s compat

ROOT = Path(__file__).parent
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
