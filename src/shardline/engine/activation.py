"""Activation checkpointing aligned to modules: recompute a module's activations in backward."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from shardline.engine.traversal import post_order
from shardline.engine.wrapping import check_policy_matches

__all__ = ["apply_activation_checkpointing", "disable_kv_cache", "is_checkpointed"]

_MARK = "_shardline_checkpointed"

log = logging.getLogger(__name__)


class _CheckpointedForward:
    """Replaces ``module.forward``: runs the original forward under non-reentrant checkpointing.

    Note: why patch ``forward`` instead of wrapping the module. A wrapper module would add a
    path component to every parameter name (breaking checkpoints and wrap policies that look
    for the block class), while an instance-level ``forward`` keeps the module, its class, its
    hooks and its state-dict keys unchanged. ``fully_shard``'s hooks run in ``__call__``
    around this forward, so a unit gathers its parameters before the checkpointed region, and
    the recomputation in backward finds them gathered again by the unit's pre-backward hook.
    Non-reentrant checkpointing is the variant that works with those hooks.
    """

    def __init__(self, forward: Callable[..., Any]) -> None:
        self.forward = forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # nothing is saved for backward anyway
            return self.forward(*args, **kwargs)
        return checkpoint(self.forward, *args, use_reentrant=False, **kwargs)


def is_checkpointed(module: nn.Module) -> bool:
    """Whether :func:`apply_activation_checkpointing` patched ``module``."""
    return bool(module.__dict__.get(_MARK, False))


def apply_activation_checkpointing(model: nn.Module, policy: Callable[[nn.Module], bool]) -> list[str]:
    """Recompute the activations of every module matching ``policy`` during backward.

    Saves the memory of everything inside the matched modules at the cost of a second
    forward through them in backward; numerics are unchanged (RNG state is preserved).
    Apply before or after sharding. Returns the names of the patched modules.

    A Hugging Face model's KV cache is turned off (``config.use_cache = False``, logged once),
    as transformers does for its own gradient checkpointing: see :func:`disable_kv_cache`.

    Raises:
        PolicyMatchError: ``policy`` matched no module of ``model``.
    """
    check_policy_matches(model, policy, purpose="activation checkpointing")
    patched = []
    for name, module in post_order(model):
        if module is model or not policy(module) or is_checkpointed(module):
            continue
        module.forward = _CheckpointedForward(module.forward)
        module.__dict__[_MARK] = True
        patched.append(name)
    if patched:
        disable_kv_cache(model)
    return patched


def disable_kv_cache(model: nn.Module) -> list[str]:
    """Set ``config.use_cache = False`` on every Hugging Face config under ``model``; returns their class names.

    Note: why. A decoder with ``use_cache=True`` builds a KV cache during a training forward and
    every layer appends its keys and values to it. Recomputing a checkpointed layer in backward
    runs that layer again against the cache the whole forward filled, so it can see other
    tensors than the forward did (torch's checkpoint then counts a different number of saved
    tensors, or attention sees twice the keys), and the cache holds every layer's keys and
    values for nothing -- the memory checkpointing was meant to save. transformers turns the
    cache off for its own ``gradient_checkpointing_enable()`` (only for that flag); this does
    the same when shardline checkpoints the layers. Duck-typed: any ``module.config`` with a
    true ``use_cache``.
    """
    changed: list[str] = []
    seen: set[int] = set()
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is None or id(config) in seen:
            continue
        seen.add(id(config))
        if getattr(config, "use_cache", False) is True:
            config.use_cache = False
            changed.append(type(config).__name__)
    if changed:
        log.info(
            "activation checkpointing: set use_cache=False on %s (a KV cache is not used in training, and a "
            "recomputed layer must see the tensors its forward saw)",
            ", ".join(changed),
        )
    return changed
