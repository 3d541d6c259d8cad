"""Gradient clipping by the true global norm inside Lightning's precision plugins.

Lightning clips in its precision plugin: ``Trainer(gradient_clip_val=...)`` ends in
``precision_plugin.clip_gradients``, whose default clips the norm of the optimizer's
parameters -- on a sharded model, this rank's shards only, so every rank would scale by a
different, too small norm. :func:`clip_globally` gives a plugin instance a subclass whose
``clip_gradients`` clips by the norm of the whole model instead (``shardline.clip_grad_norm_``:
one all-reduce) and logs that norm.

Note: why a subclass made at run time. The plugin Lightning picked (``Precision``,
``MixedPrecision``, ``HalfPrecision``...) must keep its class for everything else -- autocast,
``isinstance`` checks, its checkpoint key (``__qualname__``) -- so only ``clip_gradients`` is
replaced, the way ``shardline.fully_shard`` gives a module its ``Sharded*`` class.
"""

from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING, Protocol

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule

__all__ = ["GlobalNormClipping", "clip_globally", "log_metric"]


class _Clipper(Protocol):
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor: ...

    def log_grad_norm(self, norm: torch.Tensor) -> None: ...


class GlobalNormClipping:
    """Mixin for a Lightning precision plugin: clip and log by the global gradient norm of a sharded model."""

    _shardline_clipper: _Clipper

    def clip_gradients(
        self,
        optimizer: torch.optim.Optimizer,
        clip_val: float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """Compute the global norm on every rank (clipping to ``clip_val`` when clipping by norm), log it,
        and clip by value when asked (elementwise, so the shards alone are right)."""
        by_norm = clip_val > 0 and gradient_clip_algorithm == GradClipAlgorithmType.NORM
        norm = self._shardline_clipper.clip_grad_norm_(clip_val if by_norm else math.inf)
        self._shardline_clipper.log_grad_norm(norm)
        if clip_val > 0 and gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            self.clip_grad_by_value(optimizer, clip_val)  # type: ignore[attr-defined]


_CLASSES: dict[type, type] = {}


def clip_globally(plugin: Precision, clipper: _Clipper) -> Precision:
    """Give ``plugin`` (in place) global-norm clipping through ``clipper``; returns it."""
    cls = type(plugin)
    if not issubclass(cls, GlobalNormClipping):
        new = _CLASSES.get(cls)
        if new is None:
            new = type(cls.__name__, (GlobalNormClipping, cls), {"__module__": cls.__module__})
            new.__qualname__ = cls.__qualname__  # Lightning keys the plugin's checkpoint state by it
            _CLASSES[cls] = new
        plugin.__class__ = new
    plugin._shardline_clipper = clipper  # type: ignore[attr-defined]
    return plugin


def log_metric(module: LightningModule, name: str, value: torch.Tensor) -> None:
    """``module.log(name, value)`` per step, where Lightning allows logging (skipped elsewhere)."""
    # e.g. clip_gradients called by the user from a hook that may not log: skip the metric, not the clipping
    with contextlib.suppress(MisconfigurationException):
        module.log(name, value.detach(), on_step=True, on_epoch=False, prog_bar=False, logger=True)
