"""One strategy vocabulary: every command and API that takes a sharding strategy accepts the same names.

The table below is written out by hand (not read from the engine), so a name that one entry point
drops -- ``shardline plan --strategy fsdp`` refused what ``shardline train trainer.strategy=fsdp``
takes by default -- fails here.
"""

from __future__ import annotations

import json

import pytest

from shardline.cli import main
from shardline.engine import ShardingStrategy
from shardline.errors import ConfigurationError
from shardline.train.config import compose_config, to_train_config

S = ShardingStrategy
NAMES = {
    "fsdp": S.FULL_SHARD,
    "full_shard": S.FULL_SHARD,
    "FULL_SHARD": S.FULL_SHARD,
    "zero3": S.FULL_SHARD,
    "zero2": S.SHARD_GRAD_OP,
    "shard_grad_op": S.SHARD_GRAD_OP,
    "zero1": S.SHARD_OPT,
    "shard_opt": S.SHARD_OPT,
    "ddp": S.NO_SHARD,
    "no_shard": S.NO_SHARD,
    "zero0": S.NO_SHARD,
    "hsdp": S.HYBRID_SHARD,
    "hybrid_shard": S.HYBRID_SHARD,
    "hybrid-shard": S.HYBRID_SHARD,
    "hsdp_zero2": S.HYBRID_SHARD_ZERO2,
    "hybrid_shard_zero2": S.HYBRID_SHARD_ZERO2,
}


def test_the_vocabulary_is_the_engines() -> None:
    assert {name: S.parse(name) for name in NAMES} == NAMES
    assert set(S.vocabulary()) == {name.lower().replace("-", "_") for name in NAMES}


@pytest.mark.parametrize("name", sorted(NAMES))
def test_shardline_train_selects_the_named_strategy(name: str) -> None:
    cfg = to_train_config(compose_config([f"trainer.strategy={name}"]))
    assert cfg.trainer.strategy.sharding is NAMES[name]


@pytest.mark.parametrize("name", ["fsdp", "zero3", "zero2", "shard_opt", "ddp", "hsdp", "hybrid_shard_zero2"])
def test_shardline_plan_predicts_the_named_strategy(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "model.dim=256", "model.n_layers=4", "--gpu", "L4", "--gpus-per-node", "2", "--nodes", "2",
            "--global-batch", "8", "--strategy", name, "--top", "1", "--json"]  # fmt: skip
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    [record] = json.loads(out)
    assert record["strategy"] == NAMES[name].value


def test_library_entry_points_take_the_vocabulary() -> None:
    from shardline.lightning import ShardlineStrategy

    assert ShardlineStrategy(sharding_strategy="fsdp").sharding_strategy is S.FULL_SHARD
    assert ShardlineStrategy(sharding_strategy="zero2").sharding_strategy is S.SHARD_GRAD_OP


def test_an_unknown_name_lists_the_vocabulary(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigurationError, match=r"unknown sharding strategy 'fsdp3'\. Did you mean 'fsdp'\?"):
        S.parse("fsdp3")
    assert main(["train", "trainer.strategy=zer3", "--cfg", "job"]) == 2
    err = capsys.readouterr().err
    assert "unknown trainer strategy 'zer3' (did you mean 'zero3'?)" in err
    assert "full_shard" in err
