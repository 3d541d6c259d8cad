"""``checkpoint.keep_best_k`` in ``shardline train``: bad settings refused before training (a run that keeps its
best checkpoints: tests/train/test_trained_run.py)."""

from __future__ import annotations

import pytest

from shardline.errors import ConfigurationError
from shardline.train.config import compose_config, to_train_config, validate


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["checkpoint.keep_best_k=-1", "checkpoint.monitor=val_loss"], "keep_best_k must be a non-negative integer"),
        (["checkpoint.keep_best_k=2"], "keep_best_k=2 needs checkpoint.monitor"),
        (["checkpoint.keep_best_k=2", "checkpoint.monitor=val_loss", "checkpoint.mode=lowest"], "mode must be"),
        (["checkpoint.keep_best_k=2", "checkpoint.monitor=val_accuracy"], "'val_accuracy' is never logged"),
    ],
)
def test_bad_best_k_settings_are_refused_before_training(overrides: list[str], match: str) -> None:
    cfg = to_train_config(compose_config(["experiment=tiny_gpt", *overrides]))
    with pytest.raises(ConfigurationError, match=match):
        validate(cfg, launched=True)
