"""The Trainer's ``Accelerator``, taught that a shardline-sharded model is already data parallel.

``transformers.Trainer`` hands the model to ``accelerate.Accelerator`` in three places that
matter for a sharded model: ``prepare``/``prepare_model`` (which wraps a model in torch DDP
whenever several processes train), ``no_sync`` (gradient accumulation: Trainer enters it for
every micro-batch but the last) and ``clip_grad_norm_`` (``max_grad_norm``, and the grad norm
Trainer logs). :func:`for_sharded_model` gives the Trainer's accelerator a subclass whose
public methods below act, for the sharded model only:

* ``prepare_model``: no DDP (shardline reduces gradients itself and refuses to be wrapped) and
  no device move (the shards are placed), but autocast for ``bf16``/``fp16`` exactly as
  Accelerate applies it -- through Accelerate's own ``evaluation_mode`` path, which does
  everything but the wrap;
* ``no_sync``: shardline's ``no_sync`` (no gradient collective until the last micro-batch);
* ``clip_grad_norm_``: the true global norm of the whole model (one all-reduce), not the norm
  of this rank's shards, after unscaling fp16 gradients as Accelerate does;
* ``unscale_gradients``: with shardline's loss scaler in ``accelerator.scaler``
  (:mod:`shardline.hf.scaler`), that scaler's ``unscale_`` -- on every device, CPU included,
  where Accelerate unscales only under its native fp16 autocast.

Note: why a subclass made at run time. Trainer builds the accelerator itself (in
``create_accelerator_and_postprocess``) from many arguments and launcher settings; swapping the
class of that instance keeps all of it, the way ``shardline.fully_shard`` gives a module its
``Sharded*`` class. Everything else -- data loaders, gathering metrics, mixed precision state --
is Accelerate's own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import torch
from accelerate import Accelerator
from torch import nn

from shardline.engine import ShardedGradScaler, ShardedModule, clip_grad_norm_
from shardline.errors import ConfigurationError

__all__ = ["ShardedModelAccelerator", "for_sharded_model"]


class ShardedModelAccelerator:
    """Mixin for an ``accelerate.Accelerator``: leave a shardline-sharded model's data parallelism to shardline."""

    _shardline_model: Callable[[], nn.Module | None]

    def prepare_model(
        self, model: torch.nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ) -> torch.nn.Module:
        """Accelerate's ``prepare_model``; for the sharded model: autocast only, never DDP or a device move."""
        prepared: torch.nn.Module
        if isinstance(model, ShardedModule):
            prepared = super().prepare_model(model, device_placement=False, evaluation_mode=True)  # type: ignore[misc]
        else:
            prepared = super().prepare_model(model, device_placement, evaluation_mode)  # type: ignore[misc]
        return prepared

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager[None]:
        """Accelerate's ``no_sync``; for the sharded model its own (no gradient collective inside)."""
        if isinstance(model, ShardedModule):
            return model.no_sync()
        context: contextlib.AbstractContextManager[None] = super().no_sync(model)  # type: ignore[misc]
        return context

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2
    ) -> torch.Tensor | None:
        """Accelerate's ``clip_grad_norm_``; over the sharded model's parameters: by their global norm."""
        params = list(parameters)
        model = self._shardline_model()
        mine = {id(p) for p in model.parameters()} if isinstance(model, ShardedModule) else set()
        if not {id(p) for p in params} & mine:  # not the sharded model's: Accelerate's own
            norm: torch.Tensor | None = super().clip_grad_norm_(params, max_norm, norm_type)  # type: ignore[misc]
            return norm
        assert isinstance(model, ShardedModule)
        given = {id(p) for p in params}
        if given != mine:
            raise ConfigurationError(
                f"clip_grad_norm_ was given {len(given & mine)} of the sharded model's {len(mine)} parameters; "
                "a subset's norm cannot be computed from shards. Clip all of model.parameters() (the global norm)."
            )
        self.unscale_gradients()
        return clip_grad_norm_(model, max_norm, norm_type)

    def unscale_gradients(self, optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer] | None = None) -> None:
        """Accelerate's ``unscale_gradients``; with shardline's scaler, its ``unscale_`` (one verdict for all ranks)."""
        scaler = getattr(self, "scaler", None)
        if not isinstance(scaler, ShardedGradScaler):
            super().unscale_gradients(optimizer)  # type: ignore[misc]
            return
        if optimizer is None:
            optimizers = list(getattr(self, "_optimizers", []))
        else:
            optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
        for opt in optimizers:
            while hasattr(opt, "optimizer"):  # Accelerate's AcceleratedOptimizer, around the torch optimizer
                opt = opt.optimizer
            scaler.unscale_(opt)


_CLASSES: dict[type, type] = {}


def for_sharded_model(accelerator: Accelerator, model: Callable[[], nn.Module | None]) -> Accelerator:
    """Give ``accelerator`` (in place) the behaviour of :class:`ShardedModelAccelerator`; returns it.

    ``model`` returns the sharded model (the trainer's, which is sharded after the accelerator is made).
    """
    cls = type(accelerator)
    if not issubclass(cls, ShardedModelAccelerator):
        new = _CLASSES.get(cls)
        if new is None:
            new = type(cls.__name__, (ShardedModelAccelerator, cls), {"__module__": cls.__module__})
            new.__qualname__ = cls.__qualname__
            _CLASSES[cls] = new
        accelerator.__class__ = new
    accelerator._shardline_model = model
    return accelerator
