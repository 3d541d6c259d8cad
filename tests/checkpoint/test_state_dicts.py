"""Model and optimizer state dicts of the three kinds round-trip in memory."""

from __future__ import annotations

import pytest

from shardline.testing import run_distributed
from tests.checkpoint import ranks

pytestmark = pytest.mark.numerics  # run again under another CPU kernel set by .ci/run


def test_three_kinds_roundtrip() -> None:
    results = run_distributed(ranks.state_dict_kinds, 2, timeout=60)
    for rank, checks in enumerate(results):
        failed = [name for name, ok in checks.items() if not ok]
        assert not failed, f"rank {rank}: {failed}"
    assert {"sharded_roundtrip", "local_roundtrip", "full_roundtrip"} <= results[0].keys()


def test_a_stateless_optimizer_checkpoint_loads(tmp_path) -> None:
    """Plain SGD keeps no per-parameter state; its checkpoint holds only param groups and still loads."""
    results = run_distributed(ranks.stateless_optimizer_roundtrip, 2, args=(str(tmp_path / "ck"),), timeout=90)
    for rank, got in enumerate(results):
        assert got["same_model"], f"rank {rank}: the loaded model and optimizer differ from the saved ones"
        assert got["lr"] == 0.25, f"rank {rank}: the saved learning rate was not restored ({got['lr']})"
        assert got["state"] == 0, f"rank {rank}: a stateless optimizer gained state ({got['state']})"
