"""The wheels the GPU kit carries to a machine without network: prepare them here, check them, install them there.

The GPU machine's image (``benchmarks/gpu_image.txt``) lacks a few packages the kit imports
(``benchmarks/gpu_wheels.txt``). Here, with network, ``prepare`` downloads them for CPython 3.12
on manylinux x86-64 into one folder (``gpu_wheels/``, git-ignored) and checks it; there, the kit
runs ``install``, which checks the folder again and installs it with
``pip install --no-index --no-deps --target DIR`` (no network, nothing resolved: the list names
every dependency), for ``PYTHONPATH=DIR:src:.``.

    python -m benchmarks.gpu_wheels prepare [--dest gpu_wheels]
    python -m benchmarks.gpu_wheels check [--wheels gpu_wheels]
    python -m benchmarks.gpu_wheels install --wheels gpu_wheels --target build/gpu_site

Standard library only (and ``packaging``, which pip vendors): it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.tags import Tag
    from packaging.utils import canonicalize_name, parse_wheel_filename
except ImportError:  # pragma: no cover - pip's own copy, where packaging is not installed
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]
    from pip._vendor.packaging.tags import Tag  # type: ignore[no-redef]
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parents[1]
REQUIREMENTS = ROOT / "benchmarks" / "gpu_wheels.txt"
PYTHON_VERSION = "3.12"
PLATFORM = "manylinux2014_x86_64"
LIMIT_BYTES = 64 * 2**20  # what one remote run carries besides the working tree
PREPARED = "PREPARED.txt"  # when and from which commit the folder was prepared (a copied tree may have no .git)
_MANYLINUX_X86_64 = re.compile(r"^(manylinux1|manylinux2010|manylinux2014|manylinux_\d+_\d+)_x86_64$")


class WheelsError(RuntimeError):
    """The wheel folder does not match the list: the message says what differs and how to fix it."""


@dataclass(frozen=True)
class Wheel:
    """One wheel file of the folder, by its file name."""

    path: Path
    name: str
    version: str
    tags: frozenset[Tag]

    @property
    def pure(self) -> bool:
        """Whether it is pure Python (``py3-none-any``): unpacking it is installing it."""
        return all(t.platform == "any" and t.abi == "none" for t in self.tags)


def read_requirements(path: Path = REQUIREMENTS) -> list[Requirement]:
    """The requirements of ``path``, one a line (``#`` comments and blank lines skipped)."""
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [Requirement(line) for line in lines if line]


def fits_target(tag: Tag) -> bool:
    """Whether a wheel tag installs on CPython 3.12, manylinux x86-64 (the GPU machine)."""
    if tag.platform != "any" and not _MANYLINUX_X86_64.match(tag.platform):
        return False
    if tag.abi == "none":
        return tag.interpreter in ("py3", "py312", "cp312")
    if tag.abi == "abi3":
        return re.fullmatch(r"cp3(\d+)", tag.interpreter) is not None and int(tag.interpreter[3:]) <= 12
    return tag.interpreter == "cp312" and tag.abi == "cp312"


def wheels_in(folder: Path) -> list[Wheel]:
    """The wheel files in ``folder`` (none if it does not exist)."""
    out = []
    for path in sorted(folder.glob("*.whl")) if folder.is_dir() else []:
        name, version, _build, tags = parse_wheel_filename(path.name)
        out.append(Wheel(path, canonicalize_name(name), str(version), frozenset(tags)))
    return out


def check(folder: Path, requirements: list[Requirement], *, limit_bytes: int = LIMIT_BYTES) -> list[Wheel]:
    """The folder's wheels, after checking that they are exactly ``requirements``, each for the GPU machine.

    Raises:
        WheelsError: a requirement without a wheel (or with several), a wheel no requirement names,
            a wheel for another Python or platform, or a folder over ``limit_bytes``.
    """
    fix = "rerun benchmarks/gpu_prepare.sh here (with network) and carry the folder again (docs/gpu.md)"
    wheels = wheels_in(folder)
    if not wheels:
        raise WheelsError(f"{folder}/ has no wheels (looked for *.whl); {fix}")
    problems = []
    wanted = {canonicalize_name(r.name): r for r in requirements}
    for name, req in wanted.items():
        found = [w for w in wheels if w.name == name]
        if not found:
            problems.append(f"no wheel for {req}")
        elif len(found) > 1:
            problems.append(f"{len(found)} wheels for {req}: {', '.join(w.path.name for w in found)}")
        elif not req.specifier.contains(found[0].version, prereleases=True):
            problems.append(f"{found[0].path.name} is version {found[0].version}, outside {req}")
    for wheel in wheels:
        if wheel.name not in wanted:
            problems.append(f"{wheel.path.name} is not in {REQUIREMENTS.name} (it would shadow the image's packages)")
        elif not any(fits_target(t) for t in wheel.tags):
            tags = ", ".join(sorted(str(t) for t in wheel.tags))
            problems.append(f"{wheel.path.name} ({tags}) does not install on CPython {PYTHON_VERSION} {PLATFORM}")
    size = sum(w.path.stat().st_size for w in wheels)
    if size > limit_bytes:
        problems.append(f"{size / 2**20:.1f} MiB in all, over the {limit_bytes / 2**20:.0f} MiB one run carries")
    if problems:
        raise WheelsError(f"{folder}/ does not match {REQUIREMENTS.name}: " + "; ".join(problems) + f"; {fix}")
    return wheels


def _pip(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


def _fetch(req: Requirement, into: Path) -> None:
    """One requirement's wheel into ``into``: the published wheel for the GPU machine, else one built here from the
    source distribution, which must be pure Python."""
    got = _pip(
        "download", "--only-binary=:all:", "--no-deps", "--dest", str(into), "--python-version", PYTHON_VERSION,
        "--platform", PLATFORM, "--implementation", "cp", str(req),
    )  # fmt: skip
    if got.returncode == 0:
        return
    # Note: antlr4-python3-runtime 4.9.3 (the one omegaconf 2.3 accepts) has no wheel on the index. Built here it
    # is py3-none-any, valid on any CPython 3; ``check`` refuses a built wheel that is not.
    built = _pip("wheel", "--no-deps", "--no-binary", req.name, "--wheel-dir", str(into), str(req))
    if built.returncode != 0:
        raise WheelsError(
            f"no wheel of {req} for CPython {PYTHON_VERSION} {PLATFORM} could be downloaded or built:\n"
            f"{got.stderr.strip()}\n{built.stderr.strip()}"
        )
    for wheel in wheels_in(into):
        if wheel.name == canonicalize_name(req.name) and not wheel.pure:
            raise WheelsError(f"{wheel.path.name}, built here from source, is not pure Python: it may not run there")


def _provenance() -> str:
    """One line: the date and the commit of this tree (with ``+changes`` when the tree differs from it)."""
    git = ["git", "-C", str(ROOT)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False)
    dirty = subprocess.run([*git, "status", "--porcelain", "-uno"], capture_output=True, text=True, check=False)
    commit = head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "") if head.returncode == 0 else "unknown"
    return f"prepared {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} at commit {commit}\n"


def prepare(dest: Path, requirements: list[Requirement]) -> list[Wheel]:
    """Download (or build) one wheel per requirement into a fresh ``dest``; check it; return its wheels."""
    dest = dest.resolve()
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    staging.chmod(0o755)
    try:
        for req in requirements:
            _fetch(req, staging)
        check(staging, requirements)
        (staging / PREPARED).write_text(_provenance())
        if dest.exists():
            shutil.rmtree(dest)
        staging.rename(dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return wheels_in(dest)


def install(wheels: list[Wheel], target: Path) -> str:
    """Install ``wheels`` into a fresh ``target`` without network or dependency resolution; says how it was done.

    With pip (the GPU image has it): ``pip install --no-index --no-deps --target``. Without a working pip, pure
    wheels are unpacked (that is all installing them does); any other wheel is an error.
    """
    if target.exists():
        shutil.rmtree(target)
    paths = [str(w.path) for w in wheels]
    done = _pip("install", "--no-index", "--no-deps", "--no-compile", "--quiet", "--target", str(target), *paths)
    if done.returncode == 0:
        return f"pip install --no-index --no-deps --target {target}: {len(paths)} wheels"
    if "No module named pip" not in done.stderr:
        raise WheelsError(f"pip could not install {', '.join(w.path.name for w in wheels)}:\n{done.stderr.strip()}")
    impure = [w.path.name for w in wheels if not w.pure]
    if impure:
        raise WheelsError(f"this Python has no pip, and {', '.join(impure)} cannot simply be unpacked")
    target.mkdir(parents=True)
    for wheel in wheels:
        with zipfile.ZipFile(wheel.path) as archive:
            archive.extractall(target)
    return f"this Python has no pip: unpacked {len(paths)} pure-Python wheels into {target}"


def _summary(wheels: list[Wheel]) -> str:
    size = sum(w.path.stat().st_size for w in wheels)
    lines = [f"  {w.path.name} ({w.path.stat().st_size / 1024:,.0f} KiB)" for w in wheels]
    return "\n".join([*lines, f"  {len(wheels)} wheels, {size / 2**20:.2f} MiB (limit {LIMIT_BYTES / 2**20:.0f} MiB)"])


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring); exit 0, or 1 with the reason on stderr."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    prep = commands.add_parser("prepare", help="download the wheels (here, with network) into a fresh folder")
    prep.add_argument("--dest", type=Path, default=ROOT / "gpu_wheels")
    chk = commands.add_parser("check", help="check a folder against the list")
    chk.add_argument("--wheels", type=Path, default=ROOT / "gpu_wheels")
    ins = commands.add_parser("install", help="check, then install without network into a fresh --target")
    ins.add_argument("--wheels", type=Path, default=ROOT / "gpu_wheels")
    ins.add_argument("--target", type=Path, required=True)
    args = parser.parse_args(argv)
    requirements = read_requirements()
    try:
        if args.command == "prepare":
            wheels = prepare(args.dest, requirements)
            print(f"gpu_wheels: {args.dest}/ is ready for CPython {PYTHON_VERSION} {PLATFORM}:\n{_summary(wheels)}")
        elif args.command == "check":
            wheels = check(args.wheels, requirements)
            print(f"gpu_wheels: {args.wheels}/ matches {REQUIREMENTS.name}:\n{_summary(wheels)}")
        else:
            print(f"gpu_wheels: {install(check(args.wheels, requirements), args.target)}")
    except WheelsError as exc:
        print(f"gpu_wheels: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
