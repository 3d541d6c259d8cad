"""Every shipped YAML composes and validates; overrides work; bad input is one clear error."""

from __future__ import annotations

from importlib import resources

import pytest
from omegaconf import OmegaConf

from shardline.cli import main
from shardline.errors import ConfigurationError, PolicyMatchError
from shardline.train.build import preflight
from shardline.train.config import compose_config, experiment_name, shard_degrees, to_train_config, validate
from shardline.train.schema import TrainConfig


def _options(group: str) -> list[str]:
    return sorted(
        p.name[:-5] for p in (resources.files("shardline.train.conf") / group).iterdir() if p.name.endswith(".yaml")
    )


def test_the_shipped_groups() -> None:
    assert _options("trainer_strategy") == ["ddp", "fsdp", "hsdp", "hsdp_zero2", "single_device", "zero1", "zero2"]
    assert set(_options("experiment")) >= {"tiny_gpt", "fsdp_args", "hf_llama", "hf_lora", "hf_qlora"}


# Experiments as users select them: fsdp_args is an overlay of tiny_gpt's sharding knobs.
EXPERIMENTS = ["tiny_gpt", "hf_llama", "hf_lora", "hf_qlora", "[tiny_gpt,fsdp_args]"]


def test_every_experiment_file_is_covered() -> None:
    covered = {name for e in EXPERIMENTS for name in e.strip("[]").split(",")}
    assert covered == set(_options("experiment"))


def test_an_overlay_alone_has_no_model() -> None:
    with pytest.raises(ConfigurationError, match="no model configured"):
        validate(to_train_config(compose_config(["experiment=fsdp_args"])), launched=True)


@pytest.mark.parametrize("strategy", _options("trainer_strategy"))
@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_yaml_composes_validates_and_builds(strategy: str, experiment: str) -> None:
    overrides = [f"trainer.strategy={strategy}", f"experiment={experiment}"]
    if strategy == "single_device":
        overrides.append("trainer.devices=1")
    cfg = compose_config(overrides)
    assert cfg.trainer.strategy.name == strategy, "a strategy chosen on the command line wins over the experiment's"
    OmegaConf.merge(OmegaConf.structured(TrainConfig), cfg)  # still fits the schema
    typed = to_train_config(cfg)
    assert isinstance(typed, TrainConfig)
    if strategy == "single_device" and experiment == "[tiny_gpt,fsdp_args]":
        with pytest.raises(ConfigurationError, match="mixed_precision needs a sharded strategy"):
            preflight(typed)
        return
    validate(typed, launched=True)
    policies = preflight(typed)
    assert policies.wrap is not None


def test_the_documented_override_line() -> None:
    overrides = [
        "experiment=[tiny_gpt,fsdp_args]",
        "trainer.devices=2",
        "trainer.strategy=fsdp",
        "++trainer.precision=bf16-mixed",
        "~callbacks.progress",
    ]
    cfg = compose_config(overrides)
    assert cfg.trainer.precision == "bf16-mixed"
    assert "progress" not in cfg.callbacks
    assert cfg.trainer.strategy.sharding_strategy == "full_shard"
    assert cfg.trainer.strategy.activation_checkpointing_policy._args_ == ["shardline.models.gpt.Block"]
    assert cfg.trainer.strategy.mixed_precision._target_ == "shardline.train.precision.bf16_mixed_precision"
    assert experiment_name(overrides) == "tiny_gpt+fsdp_args"
    assert compose_config(["trainer.strategy=ddp"]).trainer.strategy.sharding_strategy == "no_shard"
    assert compose_config(["trainer.strategy=zero2"]).trainer.strategy.sharding_strategy == "shard_grad_op"
    assert compose_config(["trainer.strategy=zero1"]).trainer.strategy.sharding_strategy == "shard_opt"
    hsdp = compose_config(["trainer.strategy=hsdp", "trainer.devices=2"])
    assert (hsdp.trainer.strategy.sharding_strategy, hsdp.trainer.strategy.shard_size) == ("hybrid_shard", 2)
    assert shard_degrees(to_train_config(hsdp)) == (1, 2)
    assert shard_degrees(
        to_train_config(compose_config(["trainer.strategy=hsdp", "trainer.strategy.shard_size=1"]))
    ) == (
        2,
        1,
    )
    assert shard_degrees(
        to_train_config(
            compose_config(
                ["trainer.strategy=hsdp", "trainer.strategy.shard_size=-1", "trainer.strategy.replicate_size=2"]
            )
        )
    ) == (2, 1)
    # A field of the strategy is still set with the dotted form.
    assert (
        compose_config(["trainer.strategy.reshard_after_forward=false"]).trainer.strategy.reshard_after_forward is False
    )


def test_cfg_job_prints_the_resolved_config(capsys) -> None:
    assert main(["train", "--cfg", "job", "data.seq_len=64"]) == 0
    out = OmegaConf.create(capsys.readouterr().out)
    assert out.model.seq_len == 64, "interpolations are resolved"
    assert out.trainer.strategy.name == "fsdp"


def test_help_config_lists_documented_keys(capsys) -> None:
    assert main(["train", "--help-config"]) == 0
    text = capsys.readouterr().out
    assert "trainer.precision = '32-true'" in text
    assert "autocast to bf16 around forward and loss" in text
    assert "experiment=NAME|[A,B]" in text


BAD = [
    (["experiment=nope"], r"unknown experiment 'nope'; available: fsdp_args, hf_llama, hf_lora, hf_qlora, tiny_gpt"),
    (["trainer.strategy=fsdpp"], r"unknown trainer.strategy 'fsdpp' \(did you mean 'fsdp'\?\)"),
    (["trainer.devcies=2"], r"unknown config key 'trainer.devcies'. Did you mean 'trainer.devices'\?"),
    (["trainer.devices=two"], r"invalid value for 'trainer.devices'"),
    (["trainer.strategy.sharding_strategy=zero5"], r"unknown sharding strategy 'zero5'"),
    (
        ["trainer.strategy.auto_wrap_policy._args_=[shardline.models.gpt.Blok]"],
        r"module 'shardline.models.gpt' has no attribute 'Blok'",
    ),
    (["trainer.strategy.auto_wrap_policy._args_=[no_such_pkg.Block]"], r"cannot import module 'no_such_pkg'"),
    (
        ["trainer.strategy.auto_wrap_policy._args_=[torch.nn.Conv2d]"],
        r"wrap policy layer_policy\(Conv2d\) matched no module of GPT",
    ),
    (["trainer.devices=999"], r"trainer.devices=999 but this machine has \d+ CPU cores"),
    (
        ["trainer.strategy=zero1", "trainer.strategy.cpu_offload=true"],
        r"cpu_offload=true needs a strategy with sharded parameters.*ZeRO-1 keeps whole parameters",
    ),
    (["trainer.precision=8-mixed"], r"trainer.precision='8-mixed' is not supported; use one of .*16-mixed"),
    (["trainer.strategy=single_device"], r"single_device runs one process, but trainer.devices=2"),
    (["trainer.num_nodes=2"], r"num_nodes=2 needs torchrun on every node"),
    (
        ["trainer.strategy=hsdp", "trainer.strategy.shard_size=3"],
        r"replicate_size=-1 x shard_size=3 does not match the world size 2.*divisors of 2: \[1, 2\].*"
        r"trainer.devices=2 x trainer.num_nodes=1",
    ),
    (
        ["trainer.strategy=hsdp", "trainer.strategy.shard_size=2", "trainer.strategy.replicate_size=2"],
        r"replicate_size=2 x shard_size=2 does not match the world size 2",
    ),
    (["trainer.strategy=zero2", "trainer.strategy.shard_size=2"], r"only apply to hybrid sharding.*hsdp"),
    (["trainer.strategy.reshard_after_forward=3"], r"reshard_after_forward=3 must divide the shard group's size 2"),
    (["trainer.strategy=zero1", "trainer.strategy.reshard_after_forward=2"], r"the strategy must shard parameters"),
]


@pytest.mark.parametrize(("overrides", "message"), BAD)
def test_bad_input_is_one_clear_error_before_any_worker(overrides, message, tmp_path, capsys) -> None:
    code = main(["train", f"trainer.run_root={tmp_path}", *overrides])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: ")
    import re

    assert re.search(message, " ".join(err.split())), err
    assert list(tmp_path.iterdir()) == [], "nothing is created before the config is valid"


def test_unwritable_run_directory(tmp_path, capsys) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    code = main(["train", f"trainer.run_root={blocker}"])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2
    assert f"cannot create the run directory {blocker}/tiny_gpt/" in err
    assert "Set trainer.run_root" in err


def test_policy_error_type_is_specific() -> None:
    cfg = compose_config(
        ["trainer.strategy.activation_checkpointing_policy={_target_:shardline.layer_policy,_args_:[torch.nn.GRU]}"]
    )
    with pytest.raises(
        PolicyMatchError, match="activation checkpointing policy layer_policy\\(GRU\\) matched no module"
    ):
        preflight(to_train_config(cfg))
