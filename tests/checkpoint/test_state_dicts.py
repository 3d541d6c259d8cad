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
