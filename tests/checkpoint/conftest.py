"""A committed run shared read-only by the checkpoint tests (tests that damage files copy it first)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from shardline.testing import run_distributed
from tests.checkpoint import ranks


@pytest.fixture(scope="session")
def saved_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``run/checkpoints`` with step-2 and step-4 saved by a 2-rank manager (6 steps trained)."""
    root = tmp_path_factory.mktemp("saved-run")
    directory = root / "checkpoints"
    run_distributed(ranks.run_with_manager, 2, args=(str(directory), 6, [2, 4], False), timeout=60)
    return directory


@pytest.fixture
def damaged_copy(saved_run: Path, tmp_path: Path) -> Path:
    """A private copy of step-4 that a test may alter."""
    target = tmp_path / "step-4"
    shutil.copytree(saved_run / "step-4", target)
    return target
