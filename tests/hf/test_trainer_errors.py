"""Bad input to ``ShardlineTrainer`` fails at construction with one error that names the fix (no process group needed)."""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("trl")

import transformers
from transformers import Trainer, TrainingArguments

from shardline import MixedPrecision, _transformers_compat
from shardline.errors import ConfigurationError
from shardline.hf import ShardlineTrainer, resolve_mixed_precision, resolve_wrap_policy, sharded
from shardline.hf.options import refused_arguments
from shardline.models.hf import tiny_llama

pytestmark = pytest.mark.compat  # the Trainer overrides checked against the installed transformers


class Plain(nn.Module):
    """A model with no ``_no_split_modules``."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        return {"loss": self.body(x).pow(2).mean()}


def _args(tmp_path: Path, **kw: object) -> TrainingArguments:
    return TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **kw)


def test_sharding_conflicts_are_one_error_at_construction(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # transformers 4.46 turns fsdp= into ACCELERATE_USE_FSDP=true in the environment: kept to this test.
    monkeypatch.setenv("ACCELERATE_USE_FSDP", os.environ.get("ACCELERATE_USE_FSDP", "false"))
    args = _args(tmp_path, fsdp="full_shard", torch_compile=True, load_best_model_at_end=True,
                 eval_strategy="steps", save_strategy="steps", metric_for_best_model="loss")  # fmt: skip
    with pytest.raises(ConfigurationError) as info:
        ShardlineTrainer(model=tiny_llama(), args=args)
    message = str(info.value)
    assert message.startswith("ShardlineTrainer cannot train with these TrainingArguments:")
    for fix in ("remove fsdp=", "LineageCallback()", "remove torch_compile"):
        assert fix in message, message
    assert "load_best_model_at_end" not in message, "supported: the best checkpoint is loaded at the end"
    # deepspeed= needs the deepspeed package to build TrainingArguments at all: checked on the value.
    plain = _args(tmp_path)
    plain.deepspeed = "ds_config.json"
    (problem,) = refused_arguments(plain)
    assert "deepspeed= is set" in problem
    assert "'shard_grad_op' is ZeRO-2" in problem


def test_no_split_modules_missing_names_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match=r"declares no _no_split_modules.*Pass auto_wrap_policy="):
        ShardlineTrainer(model=Plain(), args=_args(tmp_path))
    policy = resolve_wrap_policy(Plain(), nn.Linear)
    assert policy(nn.Linear(1, 1))
    assert not policy(nn.ReLU())
    llama = resolve_wrap_policy(tiny_llama(), None)
    assert [type(m).__name__ for m in tiny_llama().modules() if llama(m)] == ["LlamaDecoderLayer"] * 2
    with pytest.raises(ConfigurationError, match="auto_wrap_policy must be"):
        resolve_wrap_policy(Plain(), 3)


def test_mixed_precision_follows_bf16(tmp_path: Path) -> None:
    assert resolve_mixed_precision(_args(tmp_path), None) is None
    bf16 = resolve_mixed_precision(_args(tmp_path, bf16=True), None)
    assert bf16 == MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    given = MixedPrecision(param_dtype=torch.float16)
    assert resolve_mixed_precision(_args(tmp_path, bf16=True), given) is given


def test_sharded_makes_trainer_subclasses() -> None:
    from trl import SFTTrainer

    assert sharded(Trainer) is ShardlineTrainer
    cls = sharded(SFTTrainer)
    assert issubclass(cls, SFTTrainer)
    assert cls is sharded(SFTTrainer)
    assert sharded(cls) is cls
    with pytest.raises(ConfigurationError, match=r"takes a transformers\.Trainer subclass"):
        sharded(nn.Module)


def test_model_init_is_refused(tmp_path: Path) -> None:
    """Trainer would rebuild the model, unsharded, inside train(): refused when the trainer is built."""
    with pytest.raises(ConfigurationError, match=r"model_init= is set: Trainer would build a new, unsharded model"):
        ShardlineTrainer(model_init=lambda: tiny_llama(), args=_args(tmp_path))


def test_overrides_pass_on_the_transformers_4_46_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers 4.46 calls ``_save_checkpoint(model, trial, metrics=...)``: the override passes ``metrics`` on."""
    seen = []

    def save_checkpoint_4_46(self: Trainer, model: nn.Module, trial: object, metrics: dict | None = None) -> None:
        seen.append((model, trial, metrics, self._shardline_saving))  # save_model writes a shardline checkpoint

    monkeypatch.setattr(Trainer, "_save_checkpoint", save_checkpoint_4_46)
    trainer = ShardlineTrainer.__new__(ShardlineTrainer)  # the override alone: no model, no process group
    trainer._shardline_saving, trainer._shardline_run_dir = False, None
    model = Plain()
    trainer._save_checkpoint(model, None, metrics={"eval_loss": 0.5})
    assert seen == [(model, None, {"eval_loss": 0.5}, True)]
    assert trainer._shardline_saving is False


def test_moved_trainer_signatures_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Trainer whose overridden methods moved their parameters fails at import (and in sharded()), by name."""
    range_ = "shardline supports transformers >=4.56.2,<6"

    class Renamed(Trainer):
        def _load_optimizer_and_scheduler(self, path: str) -> None: ...

    class Forwarding(Trainer):  # *args takes any leading parameter
        def _save_checkpoint(self, *args: object, **kwargs: object) -> None: ...

    with pytest.raises(ConfigurationError) as info:
        sharded(Renamed)
    message = str(info.value)
    assert f"with the installed transformers {transformers.__version__}" in message
    assert (
        "_load_optimizer_and_scheduler(path), where shardline overrides _load_optimizer_and_scheduler(checkpoint"
        in (message)
    )
    assert range_ in message
    assert "If Renamed is your own subclass" in message
    assert issubclass(sharded(Forwarding), Forwarding)

    # At import: the module's own check against the installed Trainer, run afresh on a Trainer whose
    # _save_checkpoint lost its trial parameter and whose train is gone.
    def save_checkpoint(self: Trainer, model: nn.Module) -> None: ...

    monkeypatch.setattr(Trainer, "_save_checkpoint", save_checkpoint)
    monkeypatch.delattr(Trainer, "train")
    with pytest.raises(ConfigurationError) as info:
        runpy.run_path(_transformers_compat.__file__, run_name="shardline_transformers_compat_at_import")
    message = str(info.value)
    assert message.startswith(
        "shardline's Trainer integration does not fit transformers.trainer.Trainer with the installed transformers "
        f"{transformers.__version__}; it overrides these methods and found:\n  - train is missing\n"
        "  - _save_checkpoint(model), where shardline overrides _save_checkpoint(model, trial, ...)\n"
    ), message
    assert range_ in message
    assert "your own subclass" not in message


@pytest.mark.parametrize("version", ["4.56.1", "4.46.3", "6.0.0", "6.0.0.dev0"])
def test_transformers_outside_the_supported_range_is_refused_at_import(
    monkeypatch: pytest.MonkeyPatch, version: str
) -> None:
    # transformers swaps its lazy module in sys.modules as it loads: patch the one an import finds now.
    monkeypatch.setattr(sys.modules["transformers"], "__version__", version)
    with pytest.raises(ConfigurationError) as info:
        runpy.run_path(_transformers_compat.__file__, run_name="shardline_transformers_compat_at_import")
    assert str(info.value) == (
        f"shardline's Trainer integration does not support the installed transformers {version}. shardline "
        "supports transformers >=4.56.2,<6: install a release in that range (pip install 'transformers>=4.56.2,<6'), "
        f"or a shardline release that supports {version}."
    )


def test_an_accelerate_whose_prepare_model_moved_is_refused_at_import(monkeypatch: pytest.MonkeyPatch) -> None:
    import accelerate

    def prepare_model(self: object, model: nn.Module, evaluation_mode: bool = False) -> nn.Module: ...

    monkeypatch.setattr(accelerate.Accelerator, "prepare_model", prepare_model)
    with pytest.raises(ConfigurationError) as info:
        runpy.run_path(_transformers_compat.__file__, run_name="shardline_transformers_compat_at_import")
    assert str(info.value).startswith(
        f"shardline's Trainer integration does not fit the installed accelerate {accelerate.__version__} (with "
        f"transformers {transformers.__version__}): Accelerator.prepare_model(model, evaluation_mode), where "
        "shardline calls prepare_model(model, device_placement, evaluation_mode)."
    ), str(info.value)


def test_the_installed_transformers_is_in_the_supported_range() -> None:
    from packaging.specifiers import SpecifierSet

    assert transformers.__version__ in SpecifierSet(_transformers_compat.SUPPORTED_TRANSFORMERS, prereleases=True)
