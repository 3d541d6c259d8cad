"""Strategy YAML written for torch FSDP loads as written: use_orig_params and cpu_offload are accepted, the keys
shardline cannot honour are refused with the reason (and where they were set)."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from shardline.cli import main
from shardline.errors import ConfigurationError
from shardline.train.config import compose_config, to_train_config, validate

FSDP_STYLE = """\
# @package trainer.strategy
name: seed_fsdp
sharding_strategy: full_shard
state_dict_type: sharded
use_orig_params: true
cpu_offload: true
"""


def _strategy_dir(tmp_path: Path, text: str) -> Path:
    root = tmp_path / "configs"
    (root / "trainer_strategy").mkdir(parents=True)
    (root / "trainer_strategy" / "seed_fsdp.yaml").write_text(textwrap.dedent(text))
    return root


def test_fsdp_style_strategy_yaml_loads_as_written(tmp_path: Path) -> None:
    root = _strategy_dir(tmp_path, FSDP_STYLE)
    typed = to_train_config(compose_config(["trainer.strategy=seed_fsdp"], config_dirs=[root]))
    validate(typed, launched=True)
    assert typed.trainer.strategy.use_orig_params is True
    assert typed.trainer.strategy.cpu_offload is True


def test_use_orig_params_false_is_refused_with_the_reason() -> None:
    with pytest.raises(ConfigurationError, match=r"use_orig_params=False: shardline always trains the original"):
        to_train_config(compose_config(["trainer.strategy.use_orig_params=false"]))


@pytest.mark.parametrize(
    ("override", "reason"),
    [
        ("+trainer.strategy.limit_all_gathers=true", r"always bounds the gathers in flight"),
        ("+trainer.strategy.sync_module_states=true", r"same trainer\.seed"),
        ("trainer.strategy.param_init_fn=null", r"use trainer\.init_device=meta"),
    ],
)
def test_fsdp_keys_shardline_cannot_honour_are_refused_with_the_reason(override: str, reason: str) -> None:
    key = override.lstrip("+").split("=")[0]
    with pytest.raises(ConfigurationError) as caught:
        to_train_config(compose_config([override]))  # refused before anything is launched
    message = " ".join(str(caught.value).split())
    assert f"{key} is a torch FSDP setting shardline train does not take" in message, message
    assert re.search(reason, message), message


def test_a_refused_key_in_a_strategy_file_names_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = _strategy_dir(tmp_path, FSDP_STYLE + "limit_all_gathers: true\n")
    code = main(
        ["train", "--config-dir", str(root), f"trainer.run_root={tmp_path / 'runs'}", "trainer.strategy=seed_fsdp"]
    )
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2
    assert "trainer.strategy.limit_all_gathers is a torch FSDP setting" in err, err
    assert "seed_fsdp" in err, err


def test_a_key_added_with_plus_under_the_strategy_is_refused() -> None:
    with pytest.raises(
        ConfigurationError, match=r"unknown config key 'trainer.strategy.cpu_ofload'.*'trainer.strategy.cpu_offload'"
    ):
        to_train_config(compose_config(["+trainer.strategy.cpu_ofload=true"]))
