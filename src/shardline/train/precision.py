"""``trainer.precision`` (autocast) and the strategy's ``mixed_precision`` (parameter dtypes).

Two knobs, two jobs:

* ``trainer.precision`` decides **autocast** around forward and loss: ``32-true`` runs ops in
  the parameters' dtype, ``bf16-mixed`` runs autocast-eligible ops (matmuls, convolutions) in
  bf16 while parameters stay as they are. ``16-mixed`` does the same in fp16 and adds a
  :class:`shardline.ShardedGradScaler` (loss scaling; an overflow on any rank skips the step on all).
* ``trainer.strategy.mixed_precision`` (a :class:`shardline.MixedPrecision`) decides the dtype
  parameters are **gathered and computed in**, the dtype gradients are **reduced in**, and
  the buffers' dtype. It wins for those: with it set, gathered parameters are in its
  ``param_dtype`` whatever ``trainer.precision`` says.

With ``bf16-mixed`` and no ``mixed_precision``, parameters are gathered and gradients reduced
in fp32, and only the ops run in bf16. With both set, parameters are bf16 and autocast also
covers ops that would otherwise see fp32 inputs. The diagnostics flag the two disagreeing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Literal, get_args

import torch

from shardline.engine import MixedPrecision
from shardline.errors import ConfigurationError

__all__ = ["PRECISIONS", "Precision", "autocast", "bf16_mixed_precision", "check_precision"]

Precision = Literal["32-true", "bf16-mixed", "16-mixed"]
"""``trainer.precision``: no autocast, autocast to bf16, or autocast to fp16 with a loss scaler."""
PRECISIONS: tuple[str, ...] = get_args(Precision)


def bf16_mixed_precision() -> MixedPrecision:
    """Parameters gathered and used in bf16; gradients reduced and buffers kept in fp32."""
    return MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.float32)


def check_precision(precision: str) -> Precision:
    """``precision`` if it is one of :data:`PRECISIONS`.

    Raises:
        ConfigurationError: naming the value and the choices.
    """
    if precision not in PRECISIONS:
        raise ConfigurationError(
            f"trainer.precision={precision!r} is not supported; use one of {', '.join(PRECISIONS)} "
            "(bf16-mixed autocasts forward to bf16; 16-mixed autocasts to fp16 and scales the loss, for GPUs "
            "without bf16)"
        )
    return precision  # type: ignore[return-value]


@contextlib.contextmanager
def autocast(precision: str, device_type: str) -> Iterator[None]:
    """The autocast context ``trainer.precision`` asks for (a no-op for ``32-true``)."""
    if precision in ("bf16-mixed", "16-mixed"):
        dtype = torch.bfloat16 if precision == "bf16-mixed" else torch.float16
        with torch.autocast(device_type=device_type, dtype=dtype):
            yield
    else:
        yield
