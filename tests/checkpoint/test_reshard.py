"""Save at W ranks with one strategy, load at W' with another: parameters and optimizer state equal."""

from __future__ import annotations

import pytest
import torch

from shardline.testing import run_distributed
from tests.checkpoint import ranks

pytestmark = pytest.mark.numerics  # run again under another CPU kernel set by .ci/run


CASES = [
    # (save world, save strategy, mixed precision, kind, load world, load strategy)
    pytest.param(2, "full_shard", False, "sharded", 3, "full_shard", id="2to3", marks=pytest.mark.compat),
    pytest.param(4, "shard_grad_op", True, "sharded", 1, "full_shard", id="4to1-bf16", marks=pytest.mark.compat),
    pytest.param(1, "full_shard", False, "sharded", 4, "no_shard", id="1to4-no_shard"),
    pytest.param(2, "no_shard", False, "full", 3, "shard_grad_op", id="2to3-fullkind"),
]


def _assert_equal(expected, got) -> None:
    (full_a, optim_a), (full_b, optim_b) = expected, got
    assert full_a.keys() == full_b.keys()
    for key in full_a:
        assert torch.equal(full_a[key], full_b[key]), key
    assert optim_a["param_groups"] == optim_b["param_groups"]
    assert optim_a["state"].keys() == optim_b["state"].keys()
    for fqn, entry in optim_a["state"].items():
        assert entry.keys() == optim_b["state"][fqn].keys()
        for name, value in entry.items():
            assert torch.equal(value, optim_b["state"][fqn][name]), (fqn, name)


@pytest.mark.parametrize(("w", "strategy", "mixed", "kind", "w2", "strategy2"), CASES)
def test_reshard_parity(tmp_path, w, strategy, mixed, kind, w2, strategy2) -> None:
    path = str(tmp_path / "step-2")
    saved = run_distributed(ranks.save_trained, w, args=(path, strategy, mixed, kind), timeout=60)
    digest, expected = saved[0]
    assert all(d == digest for d, _ in saved)  # every rank learns the same manifest hash
    loaded = run_distributed(ranks.load_into, w2, args=(path, strategy2, "full"), timeout=60)
    state = ranks.unpack(loaded[0][0])
    assert state["step"] == 2
    assert state["data"] == {"epoch": 0, "position": 24}
    assert ("per_rank" in ranks.unpack(loaded[-1][0])) == (w2 <= w)  # rank r gets rank r's entry if saved
    _assert_equal(ranks.unpack(expected), ranks.unpack(loaded[0][1]))
