"""The config is typed end to end: the composed YAML becomes a ``TrainConfig``, which the launcher
checks and hands to every worker as is -- across torch's elastic launcher too."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from shardline.engine import ShardingStrategy
from shardline.errors import ConfigurationError
from shardline.train.config import compose_config, to_train_config
from shardline.train.schema import (
    CheckpointConfig,
    DataConfig,
    StrategyConfig,
    TrainConfig,
    TrainerConfig,
)
from shardline.train.worker import run_worker
from tests.train.test_cli import GPT_SMALL, SMALL, only_run_dir, shardline_train

SELECTIONS = [
    [],
    ["experiment=hf_lora"],
    ["experiment=[tiny_gpt,fsdp_args]", "trainer.strategy=zero2"],
    ["trainer.strategy=single_device", "trainer.devices=1"],
]


@pytest.mark.parametrize("overrides", SELECTIONS, ids=lambda o: " ".join(o) or "default")
def test_the_composed_config_becomes_typed_with_the_same_values(overrides: list[str]) -> None:
    composed = compose_config(overrides)
    cfg = to_train_config(composed)
    assert type(cfg) is TrainConfig
    assert type(cfg.trainer) is TrainerConfig
    assert type(cfg.trainer.strategy) is StrategyConfig
    assert type(cfg.data) is DataConfig
    assert type(cfg.checkpoint) is CheckpointConfig
    # Free-form _target_ nodes are plain data, built where they are used.
    assert type(cfg.model) is dict
    assert "_target_" in cfg.model
    # The reference: OmegaConf's own conversion of the composed config (what config.yaml and
    # every checkpoint manifest recorded before the config was typed).
    assert cfg.to_dict() == OmegaConf.to_container(composed, resolve=True)
    assert pickle.loads(pickle.dumps(cfg)) == cfg, "it crosses a process boundary unchanged"


def test_the_no_sharding_sentinel_has_one_meaning() -> None:
    assert to_train_config(compose_config(["trainer.strategy=single_device"])).trainer.strategy.sharding is None
    assert to_train_config(compose_config(["trainer.strategy=ddp"])).trainer.strategy.sharding is (
        ShardingStrategy.NO_SHARD
    )
    assert StrategyConfig(sharding_strategy="zero2").sharding is ShardingStrategy.SHARD_GRAD_OP


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.accelerator=gpu", r"trainer.accelerator='gpu'; use one of auto, cpu, cuda"),
        ("trainer.init_device=gpu", r"trainer.init_device='gpu'; use one of cpu, meta"),
        (
            "trainer.precision=8-mixed",
            r"trainer.precision='8-mixed' is not supported; use one of 32-true, bf16-mixed, 16-mixed",
        ),
        ("trainer.strategy.state_dict_type=local", r"state_dict_type='local'; use one of sharded, full"),
        ("trainer.strategy.sharding_strategy=zero5", r"unknown sharding strategy 'zero5'"),
        (
            "trainer.strategy.reshard_after_forward=maybe",
            r"must be true, false, null or a positive int dividing the shard group's size, got 'maybe'",
        ),
        ("checkpoint.verify=bogus", r"checkpoint.verify='bogus': unknown verification level 'bogus'"),
        ("checkpoint.files_per_rank=-2", r"^checkpoint.files_per_rank=-2 is not a file count; use a positive integer"),
        ("checkpoint.layout=dense", r"^checkpoint.layout='dense', .*unknown checkpoint layout 'dense'; choose"),
        ("checkpoint.segment_bytes=0", r"segment_bytes must be a positive number of bytes, got 0"),
        ("data.name=csv", r"unknown data source data.name='csv'; available: stdlib, text, jsonl, tokens"),
    ],
)
def test_enumerated_settings_are_checked_when_the_config_is_typed(override: str, message: str) -> None:
    composed = compose_config([override])  # composes: the field is a string for Hydra
    with pytest.raises(ConfigurationError, match=message):
        to_train_config(composed)


def test_a_worker_refuses_an_untyped_config() -> None:
    plain = OmegaConf.to_container(compose_config([]), resolve=True)
    with pytest.raises(ConfigurationError, match="a worker needs a TrainConfig"):
        run_worker(plain, run_dir=None, experiment="tiny_gpt")  # type: ignore[arg-type]


def test_workers_started_by_the_launcher_receive_the_typed_config(tmp_path: Path) -> None:
    record = tmp_path / "record"
    record.mkdir()
    proc = shardline_train(
        *SMALL,
        *GPT_SMALL,
        "trainer.max_steps=1",
        "trainer.val_batches=1",
        "~callbacks.tensorboard",
        "~callbacks.loss_plot",
        "~callbacks.diagnostics",
        "+callbacks.record._target_=tests.train.helpers.RecordConfigType",
        f"+callbacks.record.folder={record}",
        run_root=tmp_path / "runs",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    seen = {p.name: json.loads(p.read_text()) for p in sorted(record.iterdir())}
    assert set(seen) == {"rank0.json", "rank1.json"}, "both workers of trainer.devices=2 (spawned by the launcher)"
    for rank in seen.values():
        assert rank == {
            "config": "shardline.train.schema.TrainConfig",
            "strategy": "shardline.train.schema.StrategyConfig",
            "sharding": repr(ShardingStrategy.FULL_SHARD),
            "max_steps": 1,
            "model": "dict",
        }
    assert "max_steps: 1" in (only_run_dir(tmp_path / "runs") / "config.yaml").read_text()
