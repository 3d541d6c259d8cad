"""Checkpoints of the whole ZeRO family reshard across strategies and world sizes: SHARD_OPT at W=2 ->
HYBRID_SHARD on a 2x2 mesh -> FULL_SHARD at W=3, every load exactly what was saved."""

from __future__ import annotations

import pytest
import torch

from shardline.testing import run_distributed
from tests.checkpoint import zero_ranks
from tests.checkpoint.ranks import unpack

pytestmark = pytest.mark.numerics  # run again under another CPU kernel set by .ci/run


def _assert_equal(expected: bytes, got: bytes, where: str) -> None:
    (full_a, optim_a), (full_b, optim_b) = unpack(expected), unpack(got)
    assert full_a.keys() == full_b.keys(), where
    for key in full_a:
        assert torch.equal(full_a[key], full_b[key]), (where, key)
    assert optim_a["param_groups"] == optim_b["param_groups"], where
    for fqn, entry in optim_a["state"].items():
        for name, value in entry.items():
            assert torch.equal(value, optim_b["state"][fqn][name]), (where, fqn, name)


def test_shard_opt_to_hybrid_to_full_shard(tmp_path) -> None:
    first, second = str(tmp_path / "step-2"), str(tmp_path / "step-3")
    saved = run_distributed(zero_ranks.train_and_save, 2, args=(first, "shard_opt", 2), timeout=60)[0]
    loaded, trained, manifest = run_distributed(
        zero_ranks.load_train_save, 4, args=(first, second, "hybrid_shard"), timeout=60
    )[0]
    _assert_equal(saved, loaded, "shard_opt W=2 -> hybrid_shard 2x2")
    # The manifest records the 2-D mesh and each unit's shard x replicate degrees.
    assert manifest["mesh"] == {"shape": [2, 2], "dim_names": ["replicate", "shard"]}
    assert {(u["strategy"], u["shard_size"], u["replicate_size"]) for u in manifest["units"]} == {
        ("hybrid_shard", 2, 2)
    }
    final = run_distributed(zero_ranks.load_only, 3, args=(second, "full_shard"), timeout=60)[0]
    _assert_equal(trained, final, "hybrid_shard 2x2 -> full_shard W=3")


def test_hybrid_to_shard_opt_and_no_shard(tmp_path) -> None:
    path = str(tmp_path / "step-2")
    saved = run_distributed(zero_ranks.train_and_save, 4, args=(path, "hybrid_shard_zero2", 2), timeout=60)[0]
    _assert_equal(saved, run_distributed(zero_ranks.load_only, 3, args=(path, "shard_opt"), timeout=60)[0], "-> zero1")
    _assert_equal(saved, run_distributed(zero_ranks.load_only, 1, args=(path, "no_shard"), timeout=60)[0], "-> W=1")
