"""A callback's ``on_*`` methods must be hooks the trainer calls: a misspelt one is refused, not silently skipped."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from shardline.cli import main
from shardline.distributed import DistInfo
from shardline.errors import ConfigurationError
from shardline.train import callbacks as shipped
from shardline.train.build import build_policies
from shardline.train.callbacks import Callback
from shardline.train.config import compose_config, to_train_config
from shardline.train.diagnostics import Diagnostics
from shardline.train.export import Export
from shardline.train.hooks import HOOKS, check_callback
from shardline.train.trackers import MLflow, WandB
from shardline.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]


class MisspeltHook:
    """A user callback (no base class) whose per-step hook is misspelt: the trainer would never call it."""

    def on_step_ended(self, trainer: Any, metrics: Any) -> None:
        raise AssertionError("never called")


class MisspeltSubclass(Callback):
    """A :class:`Callback` subclass with one right hook and one misspelt one."""

    def on_fit_end(self, trainer: Any, summary: Any) -> None:
        pass

    def on_fit_begin(self, trainer: Any) -> None:
        pass


class Fine:
    """Hooks, a helper without the prefix, and an ``on_*`` attribute that is not a method: all accepted."""

    on_disk = True

    def on_fit_start(self, trainer: Any) -> None:
        pass

    def on_exception(self, trainer: Any, error: BaseException) -> None:
        pass

    def write_row(self) -> None:
        pass


def test_a_misspelt_hook_is_one_clear_error_before_any_worker(tmp_path, capsys) -> None:
    target = f"{__name__}.MisspeltHook"
    small = ["trainer.max_steps=1", "model.dim=32", "model.n_layers=1", "data.max_bytes=20000"]
    code = main(["train", f"trainer.run_root={tmp_path}", *small, f"+callbacks.mine._target_={target}"])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2, err
    assert f"callbacks.mine ({target}) has a method on_step_ended (did you mean on_step_end?)" in err
    assert f"The hooks are {', '.join(HOOKS)}" in err
    assert list(tmp_path.iterdir()) == [], "nothing is created before the callbacks are valid"


def test_the_trainer_refuses_a_misspelt_hook_before_building_anything(tmp_path) -> None:
    cfg = to_train_config(compose_config(["model.dim=32", "model.n_layers=1", "data.max_bytes=20000"]))
    info = DistInfo(rank=0, world_size=1, local_rank=0, backend="gloo", device=torch.device("cpu"))
    with pytest.raises(ConfigurationError, match=r"callbacks\[1\] \(.*MisspeltSubclass\) has a method on_fit_begin"):
        Trainer(
            cfg,
            info=info,
            run_dir=tmp_path,
            experiment="hooks",
            policies=build_policies(cfg),
            callbacks=[shipped.Summary(), MisspeltSubclass()],
        )
    assert list(tmp_path.iterdir()) == []


def test_every_unknown_method_is_named_with_its_closest_hook() -> None:
    class Two:
        def on_validation_ends(self, trainer: Any, step: int, val_loss: float) -> None:
            pass

        def on_anything(self) -> None:
            pass

    callback = Two()
    callback.on_stepend = lambda trainer, metrics: None  # type: ignore[attr-defined]
    with pytest.raises(ConfigurationError) as caught:
        check_callback(callback, where="callbacks.two")
    message = str(caught.value)
    assert "methods on_anything, on_stepend (did you mean on_step_end?), on_validation_ends (did you mean " in message
    assert "on_validation_end?)" in message


def test_hooks_a_callback_may_have_are_accepted() -> None:
    for callback in (
        Fine(),
        Callback(),
        shipped.ProgressBar(),
        shipped.MetricsCSV(),
        shipped.TensorBoard(),
        shipped.LossPlot(),
        shipped.Summary(),
        Diagnostics(),
        Export(),
    ):
        check_callback(callback, where="callbacks.x")
    for tracker in (MLflow, WandB):
        for name in dir(tracker):
            assert not name.startswith("on_") or name in HOOKS, f"{tracker.__name__}.{name}"


def test_the_base_class_the_trainer_and_the_docs_name_the_same_hooks() -> None:
    assert tuple(name for name in vars(Callback) if name.startswith("on_")) == HOOKS
    source = (ROOT / "src/shardline/train/trainer.py").read_text()
    called = set(re.findall(r'_call\("(on_\w+)"', source)) | set(re.findall(r'getattr\(callback, "(on_\w+)"', source))
    assert called == set(HOOKS)
    docs = (ROOT / "docs/training.md").read_text()
    section = docs[docs.index("## Callbacks") :]
    assert [hook for hook in HOOKS if f"`{hook}(" not in section] == []
