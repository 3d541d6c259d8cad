"""``fp16=True`` under ``ShardlineTrainer``: shardline's loss scaler in the place of Accelerate's.

Accelerate scales fp16 losses with ``torch.amp.GradScaler`` (and on CPU with none at all). Its
inf/NaN check runs on the gradients one process holds; with sharded gradients an overflow may sit
in one rank's shard alone, so that rank skips the step while the others take it, and their
scales part ways. :func:`install_scaler` puts a :class:`TrainerGradScaler` -- a
:class:`shardline.ShardedGradScaler`, whose verdict is one all-reduce over the data-parallel
group -- where Accelerate keeps its scaler (``accelerator.scaler``), before Trainer prepares the
optimizer. Accelerate then uses it through the calls it makes on any scaler:
``scale(loss).backward()`` in ``Accelerator.backward``; ``unscale_(optimizer)`` before clipping;
``step(optimizer, closure)`` and ``update()`` in ``AcceleratedOptimizer.step``, which reports a
skipped step (``optimizer_step_was_skipped``: Trainer then leaves the learning-rate schedule
where it was), the same on every rank.

Note: its state (scale, growth counter) is saved in the shardline checkpoint (the ``state``
entry ``grad_scaler``, :mod:`shardline.hf.checkpoints`), not in Trainer's ``scaler.pt``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from accelerate import Accelerator
from torch import nn

from shardline.engine import LossScaling, MixedPrecision, ShardedGradScaler
from shardline.errors import ConfigurationError

__all__ = ["TrainerGradScaler", "install_scaler", "wants_scaler"]

log = logging.getLogger("shardline.hf")


class TrainerGradScaler(ShardedGradScaler):
    """:class:`shardline.ShardedGradScaler` with the ``step(optimizer, closure)`` Accelerate calls."""

    def step(self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any] | None = None, **kwargs: Any) -> bool:
        """Unscale (if not done yet), then step unless some rank found inf/NaN; whether it stepped."""
        if closure is not None:
            kwargs["closure"] = closure
        return super().step(optimizer, **kwargs)


def wants_scaler(fp16: bool, mixed_precision: MixedPrecision | None) -> bool:
    """Whether training computes fp16 gradients: Trainer's ``fp16=True`` or ``param_dtype=float16``."""
    return bool(fp16) or (mixed_precision is not None and mixed_precision.param_dtype == torch.float16)


def install_scaler(accelerator: Accelerator, model: nn.Module, policy: LossScaling | None) -> TrainerGradScaler:
    """Give ``accelerator`` a :class:`TrainerGradScaler` over the sharded ``model``; returns it.

    Called before Trainer prepares its optimizer (``AcceleratedOptimizer`` takes the accelerator's
    scaler when it is made).
    """
    if policy is not None and not isinstance(policy, LossScaling):
        raise ConfigurationError(f"loss_scaling must be a shardline.LossScaling or None, got {type(policy).__name__}")
    replaced = getattr(accelerator, "scaler", None)
    scaler = TrainerGradScaler(model, policy=policy)
    accelerator.scaler = scaler
    log.info(
        "fp16: loss scaling by shardline's ShardedGradScaler (overflow verdict agreed by every rank)%s",
        f", in place of Accelerate's {type(replaced).__name__}" if replaced is not None else "",
    )
    return scaler
