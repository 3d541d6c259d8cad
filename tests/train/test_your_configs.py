"""Bring your own configs: --config-dir, experiment files by path, your model class, one hint for every typo."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from shardline.cli import main
from shardline.errors import ConfigurationError
from shardline.train.build import build_model, preflight
from shardline.train.config import compose_config, experiment_name, to_train_config, validate

MY_LM = """\
# @package _global_
model:
  _target_: tests.train.user_model.TinyLM
  vocab: 300
  width: 16
trainer:
  max_steps: 7
  strategy:
    auto_wrap_policy:
      _target_: shardline.layer_policy
      _args_: [tests.train.user_model.Layer]
"""

MY_STRATEGY = """\
# @package trainer.strategy
name: my_zero2
sharding_strategy: shard_grad_op
reshard_after_forward: null
state_dict_type: full
cpu_offload: false
"""


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture
def config_dir(tmp_path: Path) -> Path:
    root = tmp_path / "my_configs"
    _write(root / "experiment" / "my_lm.yaml", MY_LM)
    _write(root / "trainer_strategy" / "my_zero2.yaml", MY_STRATEGY)
    return root


def test_config_dir_adds_experiments_and_strategies(config_dir: Path, capsys) -> None:
    cfg = compose_config(["experiment=my_lm", "trainer.strategy=my_zero2"], config_dirs=[config_dir])
    assert cfg.model == {"_target_": "tests.train.user_model.TinyLM", "vocab": 300, "width": 16}
    assert cfg.trainer.max_steps == 7
    assert cfg.trainer.strategy.sharding_strategy == "shard_grad_op"
    assert cfg.trainer.strategy.state_dict_type == "full"
    typed = to_train_config(cfg)
    validate(typed, launched=True)
    preflight(typed)  # the user's class builds and the user's wrap policy matches
    assert type(build_model(typed, device="meta")).__name__ == "TinyLM"
    # The command line takes -cd and --config-dir, like Hydra's own applications.
    for flag in ("-cd", "--config-dir"):
        assert main(["train", flag, str(config_dir), "--cfg", "job", "experiment=my_lm"]) == 0
        assert OmegaConf.create(capsys.readouterr().out).model.width == 16


def test_experiment_files_by_path_with_or_without_package_line(tmp_path: Path) -> None:
    with_header = _write(tmp_path / "a" / "my-lm.yaml", MY_LM)
    without = _write(tmp_path / "b" / "short.yml", "trainer:\n  max_steps: 3\n")
    cfg = compose_config([f"experiment=[{with_header},{without}]"])
    assert cfg.model.vocab == 300
    assert cfg.trainer.max_steps == 3, "the later file wins, and a file without '# @package' is a global overlay"
    assert experiment_name([f"experiment=[{with_header},{without}]"]) == "my-lm+short"
    assert experiment_name([f"experiment={with_header}"]) == "my-lm"
    with pytest.raises(ConfigurationError, match=r"experiment=.*nope\.yaml: no such file"):
        compose_config([f"experiment={tmp_path / 'nope.yaml'}"])


def test_a_new_model_target_replaces_the_model_node(tmp_path: Path) -> None:
    mine = _write(tmp_path / "mine.yaml", MY_LM)
    # Stacked on the default experiment: none of tiny_gpt's GPT arguments leak into TinyLM.
    cfg = compose_config([f"experiment=[tiny_gpt,{mine}]", "model.width=24"])
    assert dict(cfg.model) == {"_target_": "tests.train.user_model.TinyLM", "vocab": 300, "width": 24}
    preflight(to_train_config(cfg))
    # On the command line alone, against the default experiment.
    cfg = compose_config(["model._target_=tests.train.user_model.TinyLM", "+model.vocab=64"])
    assert dict(cfg.model) == {"_target_": "tests.train.user_model.TinyLM", "vocab": 64}
    assert type(build_model(to_train_config(cfg), device="meta")).__name__ == "TinyLM"
    # An overlay that restates the same class merges as usual.
    same = _write(tmp_path / "wider.yaml", "model:\n  _target_: shardline.models.GPT\n  dim: 64\n")
    cfg = compose_config([f"experiment=[tiny_gpt,{same}]"])
    assert cfg.model.dim == 64
    assert cfg.model.n_layers == 4, "the default experiment's other arguments are kept"


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def test_a_typo_gets_the_same_did_you_mean_wherever_it_is(tmp_path: Path, config_dir: Path) -> None:
    typo = "trainer:\n  devcies: 2\n"
    _write(config_dir / "experiment" / "typo.yaml", "# @package _global_\n" + typo)
    by_path = _write(tmp_path / "typo_by_path.yaml", typo)
    hint = "unknown config key 'trainer.devcies'"
    fix = "Did you mean 'trainer.devices'? Allowed keys under 'trainer': devices, num_nodes,"
    messages = {}
    for where, overrides, dirs in (
        ("command line", ["trainer.devcies=2"], []),
        ("config dir", ["experiment=typo"], [config_dir]),
        ("path", [f"experiment={by_path}"], []),
    ):
        with pytest.raises(ConfigurationError) as info:
            compose_config(overrides, config_dirs=dirs)
        messages[where] = _one_line(info.value)
        assert messages[where].startswith(hint), messages[where]
        assert fix in messages[where]
        assert "\n" not in str(info.value)
    assert f"(set in {config_dir / 'experiment' / 'typo.yaml'})" in messages["config dir"]
    assert f"(set in {by_path})" in messages["path"]


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (
            "_target_: shardline.models.GPT\n  n_head: 2",
            r"unexpected keyword argument 'n_head'. Did you mean 'n_heads'\? Accepted arguments: vocab_size,",
        ),
        (
            "_target_: shardline.models.GTP",
            r"'shardline.models.GTP' cannot be imported. Did you mean 'shardline.models.GPT'\?",
        ),
        ("_target_: tests.train.user_model.TinyLM\n  widht: 8\n  vocab: 9", r"Did you mean 'width'\?"),
        (
            "_target_: shardline.models.hf.tiny_llama\n  hiden_size: 8",
            r"no setting 'hiden_size'. Did you mean 'hidden_size'\?",
        ),
    ],
)
def test_model_argument_typos_in_a_yaml_file(tmp_path: Path, model: str, message: str) -> None:
    if "hf" in model:
        pytest.importorskip("transformers")
    path = _write(tmp_path / "m.yaml", f"model:\n  {model}\n")
    cfg = compose_config([f"experiment={path}"])
    with pytest.raises(ConfigurationError, match=message):
        preflight(to_train_config(cfg))


def test_command_line_typo_in_a_free_form_node() -> None:
    with pytest.raises(ConfigurationError, match=r"unknown config key 'model.n_head'. Did you mean 'model.n_heads'\?"):
        compose_config(["model.n_head=2"])
    with pytest.raises(ConfigurationError, match=r"add one with a leading '\+' \(\+model.width=VALUE\)"):
        compose_config(["model.width=2"])


def test_config_dir_mistakes_are_one_clear_error(tmp_path: Path, config_dir: Path) -> None:
    with pytest.raises(ConfigurationError, match=r"--config-dir .*missing: no such directory"):
        compose_config([], config_dirs=[tmp_path / "missing"])
    _write(config_dir / "experiment" / "tiny_gpt.yaml", MY_LM)
    with pytest.raises(ConfigurationError, match=r"experiment/tiny_gpt.yaml has the name of a shipped experiment"):
        compose_config([], config_dirs=[config_dir])
    (config_dir / "experiment" / "tiny_gpt.yaml").unlink()
    _write(config_dir / "experiment" / "no_header.yaml", "trainer:\n  max_steps: 3\n")
    with pytest.raises(
        ConfigurationError, match=re.escape("Start an experiment file with the line '# @package _global_'")
    ):
        compose_config(["experiment=no_header"], config_dirs=[config_dir])
    with pytest.raises(ConfigurationError, match=r"unknown experiment 'my_ml' \(did you mean 'my_lm'\?\)"):
        compose_config(["experiment=my_ml"], config_dirs=[config_dir])


@pytest.mark.parametrize("where", ["by path, no package line", "by path, with package line", "config dir"])
def test_malformed_yaml_is_one_line_naming_your_file(capsys, tmp_path: Path, config_dir: Path, where: str) -> None:
    """A YAML syntax error names the user's file (never the temporary copy Hydra reads), line and column: exit 2."""
    from shardline.train.launcher import train

    broken = "model:\n  width: [16\n  vocab: 300\n"  # the flow sequence opened on line 2 meets ':' on line 3
    if where == "config dir":
        path = _write(config_dir / "experiment" / "broken.yaml", "# @package _global_\n" + broken)
        args, line = ["experiment=broken"], 4
    elif where == "by path, with package line":
        path = _write(tmp_path / "broken.yaml", "# @package _global_\n" + broken)
        args, line = [f"experiment=[tiny_gpt,{path}]"], 4
    else:
        path = _write(tmp_path / "broken.yaml", broken)
        args, line = [f"experiment={path}"], 3
    code = train([f"trainer.run_root={tmp_path / 'runs'}", *args], config_dirs=[config_dir])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1, f"one line, got:\n{err}"
    assert err.startswith(f"error: {path}, line {line}, column 8: invalid YAML: expected ',' or ']', but got ':'"), err
    assert f"(while parsing a flow sequence at line {line - 1}, column 10)" in err, err
    assert "shardline-experiments-" not in err, "never the temporary copy"
    assert "_file0_" not in err, "never the temporary copy"
    assert not (tmp_path / "runs").exists(), "nothing started"


@pytest.mark.parametrize(
    ("override", "hint"),
    [
        ("+trainer.max_step=10", "Did you mean 'trainer.max_steps'?"),
        ("+optimizer.lrr=3", "Did you mean 'optimizer.lr'?"),
        ("+checkpoint.keep_last=2", "Did you mean 'checkpoint.keep_last_n'?"),
        ("+bogus_section=1", "Allowed keys under 'the config root'"),
    ],
)
def test_a_key_added_with_plus_where_the_schema_is_typed_is_refused(override: str, hint: str) -> None:
    key = override[1:].split("=")[0]
    with pytest.raises(ConfigurationError, match=f"unknown config key '{key}'") as info:
        to_train_config(compose_config([override]))
    assert hint in str(info.value)


def test_free_form_nodes_still_take_added_keys() -> None:
    cfg = to_train_config(compose_config(["+checkpoint.storage_options.region_name=r", "+tracking.tags.team=x"]))
    assert cfg.checkpoint.storage_options == {"region_name": "r"}
    assert cfg.tracking.tags["team"] == "x"
