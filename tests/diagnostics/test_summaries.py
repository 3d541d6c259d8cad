"""Diagnostics name the three classic FSDP failures: policy matched nothing, dtypes not applied, memory per phase."""

from __future__ import annotations

import torch

import shardline
from shardline.diagnostics.summaries import policy_summary, precision_summary, rank_summary, unit_summary
from shardline.engine import subtree_units
from shardline.testing import run_distributed
from tests.models import Block, ParityModel

BF16 = shardline.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def test_precision_mismatch_is_flagged() -> None:
    lines, warnings = precision_summary("bf16-mixed", None)
    assert "parameters gathered in their own dtype" in lines[0]
    assert len(warnings) == 1
    assert "no trainer.strategy.mixed_precision is set" in warnings[0]
    assert "communication is not halved" in warnings[0]

    _, warnings = precision_summary("32-true", BF16)
    assert len(warnings) == 1
    assert "computes in bfloat16" in warnings[0]

    for precision, mp in (("bf16-mixed", BF16), ("32-true", None)):
        assert precision_summary(precision, mp)[1] == [], "consistent settings raise nothing"


def _ranks(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    good = shardline.wrap(ParityModel(n_blocks=3), shardline.layer_policy(Block))
    # A policy that matches only tiny modules: the root keeps nearly everything.
    bad_policy = shardline.layer_policy(torch.nn.LayerNorm)
    bad = shardline.wrap(ParityModel(n_blocks=3), bad_policy)
    return {
        "good": rank_summary(rank, world_size, good, subtree_units(good)),
        "bad": rank_summary(rank, world_size, bad, subtree_units(bad)),
        "units": unit_summary(subtree_units(good), world_size),
        "policy": policy_summary(bad, subtree_units(bad), bad_policy, None),
    }


def test_policy_that_matched_almost_nothing_and_uneven_shards() -> None:
    res = run_distributed(_ranks, 4)
    good_lines, good_warnings = res[0]["good"]
    assert good_lines[0].startswith("[rank 0] 4 units, 0 activation-checkpointed modules")
    assert not any("matched almost nothing" in w for w in good_warnings)
    assert any("[rank 0] holds 1.25x its even share" in w for w in good_warnings), good_warnings
    _, bad_warnings = res[0]["bad"]
    assert any("unit '<root>' holds" in w and "matched almost nothing" in w for w in bad_warnings), bad_warnings
    assert "wrap policy layer_policy(LayerNorm) matched 4 modules: 4 x LayerNorm" in res[0]["policy"][0]
    # On 4 ranks the 2-row gate and the 7-row fc1 leave the last rank short.
    _, last_warnings = res[3]["good"]
    assert any("[rank 3] holds" in w and "uneven torch.chunk shards" in w for w in last_warnings), last_warnings
    assert res[0]["units"][0] == "4 units over 4 ranks"
    assert "blocks.0, blocks.1, blocks.2: full_shard, frees gathered parameters after forward" in res[0]["units"][2]


def _even(rank: int, world_size: int) -> list[str]:
    from shardline.models import GPT
    from shardline.models.gpt import Block as GPTBlock

    model = shardline.wrap(GPT(dim=32, n_layers=2, n_heads=2, seq_len=16), shardline.layer_policy(GPTBlock))
    return rank_summary(rank, world_size, model, subtree_units(model))[1]


def test_an_evenly_divisible_model_raises_no_warning() -> None:
    assert run_distributed(_even, 2) == [[], []]
