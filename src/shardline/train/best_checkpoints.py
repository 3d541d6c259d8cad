"""Best-k checkpoints of a training run: the metrics each save records, and the checks made before training.

``shardline train`` measures two things a checkpoint can be ranked by: ``val_loss``, the
validation loss of the saved step (present only when that step was evaluated: every
``trainer.val_check_interval`` steps and the last), and ``loss``, the training loss of the saved
step. :func:`measured` gives them to the save (``SaveRequest.metrics``); the manager records
them in the checkpoint's commit row (:mod:`shardline.checkpoint.provenance.best`).
"""

from __future__ import annotations

import logging
from typing import Any

from shardline.checkpoint.provenance.best import BestPolicy
from shardline.errors import ConfigurationError
from shardline.train.schema import TrainConfig

__all__ = ["MONITORED", "check_best_k", "measured"]

log = logging.getLogger("shardline.train")

MONITORED = ("val_loss", "loss")
"""The metrics ``checkpoint.monitor`` may name: what the trainer measures at a saved step."""


def check_best_k(cfg: TrainConfig) -> BestPolicy:
    """``cfg.checkpoint``'s best-k policy, checked before any worker starts.

    Raises:
        ConfigurationError: ``keep_best_k`` negative, ``mode`` not min/max, ``keep_best_k`` without
            ``monitor``, or a ``monitor`` the trainer never logs (the message lists the ones it does).
    """
    c = cfg.checkpoint
    policy = BestPolicy(keep_best_k=c.keep_best_k, monitor=c.monitor or None, mode=c.mode)
    if c.monitor and c.monitor not in MONITORED:
        raise ConfigurationError(
            f"checkpoint.monitor={c.monitor!r} is never logged by shardline train: it measures "
            f"{', '.join(MONITORED)} at a saved step (val_loss: the validation loss, at evaluated steps)"
        )
    every, interval = c.every_n_steps, cfg.trainer.val_check_interval
    if policy.active and c.monitor == "val_loss" and every and interval and every % interval:
        log.warning(
            "checkpoint.every_n_steps=%d is not a multiple of trainer.val_check_interval=%d: checkpoints saved at "
            "steps without an evaluation have no val_loss and are never kept as best",
            every,
            interval,
        )
    return policy


def measured(trainer: Any, step: int) -> dict[str, float]:
    """What the trainer measured at ``step``: ``val_loss`` if it evaluated after it, ``loss`` if it logged it."""
    out: dict[str, float] = {}
    if trainer.metrics and trainer.metrics[-1].step == step:
        out["loss"] = float(trainer.metrics[-1].loss)
    if trainer.val_history and int(trainer.val_history[-1][0]) == step:
        out["val_loss"] = float(trainer.val_history[-1][1])
    return out
