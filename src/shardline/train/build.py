"""Turn config nodes into objects: the model, the wrap / checkpointing policies, mixed precision.

Also the *preflight*: build the model on the meta device in the launching process and apply
the policies to it, so a class path that does not import or a policy that matches nothing is
reported before any worker starts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from torch import nn

from shardline.engine import MixedPrecision, check_policy_matches
from shardline.errors import ConfigurationError, ShardlineError
from shardline.train.compiling import check_compile_supported
from shardline.train.config import resolve_accelerator
from shardline.train.hints import keyword_hint, target_hint
from shardline.train.hooks import check_callback
from shardline.train.schema import TrainConfig

__all__ = ["Policies", "build_callbacks", "build_model", "build_policies", "preflight"]


def instantiate_node(node: Any, where: str) -> Any:
    """``hydra.utils.instantiate`` with errors that name the config key."""
    if node is None:
        return None
    try:
        return instantiate(node)
    except InstantiationException as exc:
        cause = exc.__cause__
        while isinstance(cause, InstantiationException) and cause.__cause__ is not None:
            cause = cause.__cause__
        if isinstance(cause, ShardlineError):
            raise ConfigurationError(f"{where}: {cause}") from None
        target = node.get("_target_") if isinstance(node, Mapping) else None
        if isinstance(cause, ImportError) and "Error loading" in str(cause):
            detail = f"'{target}' cannot be imported.{target_hint(target)}"
        else:
            detail = str(cause) if cause is not None else str(exc).strip().splitlines()[0]
            if isinstance(cause, TypeError):
                detail += keyword_hint(target, cause)
        raise ConfigurationError(f"{where} (_target_: {target}) cannot be built: {detail}") from None


class Policies:
    """The strategy's model-specific objects."""

    def __init__(self, cfg: TrainConfig) -> None:
        strategy = cfg.trainer.strategy
        self.wrap = instantiate_node(strategy.auto_wrap_policy, "trainer.strategy.auto_wrap_policy")
        self.checkpointing = instantiate_node(
            strategy.activation_checkpointing_policy, "trainer.strategy.activation_checkpointing_policy"
        )
        self.mixed_precision = instantiate_node(strategy.mixed_precision, "trainer.strategy.mixed_precision")
        for name, value in (("auto_wrap_policy", self.wrap), ("activation_checkpointing_policy", self.checkpointing)):
            if value is not None and not callable(value):
                raise ConfigurationError(
                    f"trainer.strategy.{name} must build a callable module -> bool (e.g. shardline.layer_policy), "
                    f"got {type(value).__name__}"
                )
        if self.mixed_precision is not None and not isinstance(self.mixed_precision, MixedPrecision):
            raise ConfigurationError(
                "trainer.strategy.mixed_precision must build a shardline.MixedPrecision, got "
                f"{type(self.mixed_precision).__name__}"
            )
        if self.mixed_precision is not None and strategy.sharding is None:
            raise ConfigurationError(
                "trainer.strategy.mixed_precision needs a sharded strategy (fsdp, zero2, zero1, ddp or hsdp); with "
                "single_device use trainer.precision=bf16-mixed instead"
            )


def build_callbacks(cfg: TrainConfig) -> list[object]:
    """The configured callbacks, in config order; each checked to name only hooks the trainer calls."""
    callbacks: list[object] = []
    for name, node in (cfg.callbacks or {}).items():
        if node:
            callback = instantiate_node(node, f"callbacks.{name}")
            check_callback(callback, where=f"callbacks.{name}")
            callbacks.append(callback)
    return callbacks


def build_policies(cfg: TrainConfig) -> Policies:
    """The strategy's wrap and activation-checkpointing policies and mixed precision, built."""
    return Policies(cfg)


def build_model(cfg: TrainConfig, *, device: torch.device | str) -> nn.Module:
    """Instantiate ``cfg.model`` on ``device`` (``meta`` for deferred initialization)."""
    with torch.device(device):
        model = instantiate_node(cfg.model, "model")
    if not isinstance(model, nn.Module):
        raise ConfigurationError(f"model._target_ must build an nn.Module, got {type(model).__name__}")
    return model


def preflight(cfg: TrainConfig) -> Policies:
    """Build the model on meta and check every policy and callback (no memory, no workers)."""
    policies = build_policies(cfg)
    build_callbacks(cfg)
    if cfg.trainer.compile:
        check_compile_supported(device_type=resolve_accelerator(cfg.trainer.accelerator))
    model = build_model(cfg, device="meta")
    if policies.wrap is not None:
        check_policy_matches(model, policies.wrap, purpose="wrap")
    if policies.checkpointing is not None:
        check_policy_matches(model, policies.checkpointing, purpose="activation checkpointing")
    return policies
