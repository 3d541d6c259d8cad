"""Declared ranges are tested ranges: pyproject.toml, the compat modules and docs/testing.md's matrix agree.

The floors pyproject.toml declares are the versions ``nox -s compat`` installs (noxfile.py reads
them from there); these checks keep the rest in step: the ranges the compat modules refuse
outside of, the copies of the floors in the ``test`` extra, and the recorded results, in which
every floor, torch 2.11, and the newest torch installable must have passed.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from shardline import _torch_compat

tomllib = pytest.importorskip("tomllib", reason="reads pyproject.toml with Python 3.11's tomllib")

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
LIBRARIES = ("torch", "transformers", "trl", "peft", "accelerate", "datasets", "lightning")


def _requirements(lines: list[str]) -> dict[str, Requirement]:
    return {(req := Requirement(line)).name: req for line in lines}


def _floor(req: Requirement) -> Version:
    return next(Version(spec.version) for spec in req.specifier if spec.operator == ">=")


def _matrix() -> list[dict[str, str]]:
    """The rows of the results table in docs/testing.md (the one whose header starts with ``| session``)."""
    lines = (ROOT / "docs" / "testing.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| session |"))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(header, (c.strip().strip("`") for c in line.strip("|").split("|")), strict=True)))
    return rows


def test_compat_modules_check_the_declared_ranges() -> None:
    pytest.importorskip("transformers")
    from shardline import _transformers_compat

    core = _requirements(PROJECT["dependencies"])
    hf = _requirements(PROJECT["optional-dependencies"]["hf"])
    assert str(core["torch"].specifier) == _torch_compat.SUPPORTED_TORCH
    assert hf["transformers"].specifier == _transformers_compat.SUPPORTED_TRANSFORMERS


def test_the_test_extra_repeats_the_floors() -> None:
    extras = PROJECT["optional-dependencies"]
    test = _requirements(extras["test"])
    for extra in ("hf", "lightning"):
        for name, req in _requirements(extras[extra]).items():
            assert test[name].specifier == req.specifier, (extra, name)


def test_every_floor_and_the_named_releases_passed_in_the_recorded_matrix() -> None:
    declared = {**_requirements(PROJECT["dependencies"])}
    for extra in ("hf", "lightning"):
        declared.update(_requirements(PROJECT["optional-dependencies"][extra]))
    rows = _matrix()
    passed = [row for row in rows if row["result"] == "pass"]
    assert passed, rows

    def ran(library: str, version: Version) -> bool:
        return any(Version(re.sub(r"\+.*", "", row[library])) == version for row in passed)

    for library in LIBRARIES:
        floor = _floor(declared[library])
        assert ran(library, floor), f"no passing session in docs/testing.md ran {library} {floor}, the declared floor"
    for torch_release in ("2.11.0", "2.13.0", "2.14.1"):  # the acceptance release, the default, the newest here
        assert ran("torch", Version(torch_release)), torch_release
