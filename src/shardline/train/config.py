"""Compose and validate the ``shardline train`` config: YAML layers + overrides onto typed schemas.

Every failure becomes one :class:`~shardline.errors.ConfigurationError` whose message names the
offending key or value and what is allowed, raised before any worker starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from collections.abc import Sequence
from typing import Any

import torch
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

from shardline.checkpoint.verify import VerifyLevel
from shardline.engine.strategy import ShardingStrategy
from shardline.errors import ConfigurationError
from shardline.train.precision import check_precision
from shardline.train.schema import TrainConfig, register_schemas

__all__ = ["CONFIG_MODULE", "DEFAULT_EXPERIMENT", "compose_config", "experiment_name", "validate"]

CONFIG_MODULE = "shardline.train.conf"
DEFAULT_EXPERIMENT = "tiny_gpt"

# "trainer.strategy=fsdp" reads naturally and is what Lightning+Hydra users type; in Hydra it
# would assign a string to the strategy node. A bare name selects the trainer_strategy group.
_STRATEGY_SELECT = re.compile(r"^trainer\.strategy=([A-Za-z_][A-Za-z0-9_]*)$")


def rewrite_overrides(overrides: Sequence[str]) -> list[str]:
    """Turn ``trainer.strategy=NAME`` into the group selection ``trainer_strategy=NAME``."""
    out = []
    for override in overrides:
        match = _STRATEGY_SELECT.match(override)
        out.append(f"trainer_strategy={match.group(1)}" if match else override)
    return out


def experiment_name(overrides: Sequence[str]) -> str:
    """The experiment(s) selected by the overrides, joined with '+' (default: tiny_gpt)."""
    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except OverrideParseException:
        return DEFAULT_EXPERIMENT
    for override in parsed:
        if override.key_or_group == "experiment" and not override.is_delete():
            value = override.value()
            names = value if isinstance(value, list) else [value]
            return "+".join(str(n) for n in names) or DEFAULT_EXPERIMENT
    return DEFAULT_EXPERIMENT


def compose_config(overrides: Sequence[str] = ()) -> DictConfig:
    """The fully composed, schema-checked config for ``overrides`` (Hydra override syntax)."""
    register_schemas()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
            cfg = compose(config_name="config", overrides=rewrite_overrides(overrides))
    except (ConfigCompositionException, MissingConfigException, OverrideParseException, OmegaConfBaseException) as exc:
        raise ConfigurationError(_explain(exc)) from None
    finally:
        GlobalHydra.instance().clear()
    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as exc:
        raise ConfigurationError(f"cannot resolve an interpolation in the config: {_first_line(exc)}") from None
    return cfg


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _schema_fields(path: Sequence[str]) -> list[str] | None:
    """Field names of the schema node at ``path`` (None when the node is free-form)."""
    node: Any = TrainConfig
    for part in path:
        if not dataclasses.is_dataclass(node):
            return None
        types = {f.name: f for f in dataclasses.fields(node)}
        if part not in types:
            return None
        default = types[part].default_factory if types[part].default_factory is not dataclasses.MISSING else None
        node = default() if default is not None else None
    if dataclasses.is_dataclass(node):
        return [f.name for f in dataclasses.fields(node)]
    return None


def _explain(exc: BaseException) -> str:
    cause = exc.__cause__ or exc
    if isinstance(exc, MissingConfigException):
        text = str(exc)
        missing = re.search(r"Could not find '([^'/]+)/([^']+)'", text)
        options = re.findall(r"^\t(\S+)$", text, flags=re.M)
        if missing:
            group, name = missing.groups()
            key = "trainer.strategy" if group == "trainer_strategy" else group
            hint = difflib.get_close_matches(name, options, n=1)
            return (
                f"unknown {key.replace('_', ' ')} {name!r}"
                + (f" (did you mean {hint[0]!r}?)" if hint else "")
                + f"; available: {', '.join(options)}. Pass {key}=NAME with one of them."
            )
        return _first_line(exc)
    if isinstance(exc, OverrideParseException):
        return f"cannot parse the command-line overrides: {_first_line(exc)} (Hydra override syntax: key=value)"
    unknown_key = (ConfigKeyError, ConfigAttributeError)
    if isinstance(cause, (*unknown_key, ValidationError)) and getattr(cause, "full_key", None):
        full_key = str(cause.full_key)
        parts = full_key.split(".")
        if isinstance(cause, unknown_key):
            allowed = _schema_fields(parts[:-1])
            if allowed is not None:
                close = difflib.get_close_matches(parts[-1], allowed, n=1)
                prefix = ".".join(parts[:-1])
                hint = f" Did you mean '{prefix + '.' if prefix else ''}{close[0]}'?" if close else ""
                return (
                    f"unknown config key '{full_key}'.{hint} Allowed keys under '{prefix or '<root>'}': "
                    f"{', '.join(allowed)}."
                )
            return f"unknown config key '{full_key}'"
        return f"invalid value for '{full_key}': {_first_line(cause)}"
    return _first_line(exc) + (f": {_first_line(cause)}" if cause is not exc else "")


_ACCELERATORS = ("auto", "cpu", "cuda")
_STATE_DICT_TYPES = ("sharded", "full")
_INIT_DEVICES = ("cpu", "meta")


def resolve_accelerator(accelerator: str) -> str:
    """``auto`` -> cuda when available, else cpu; cuda when unavailable is an error."""
    if accelerator not in _ACCELERATORS:
        raise ConfigurationError(f"trainer.accelerator={accelerator!r}; use one of {', '.join(_ACCELERATORS)}")
    if accelerator == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if accelerator == "cuda" and not torch.cuda.is_available():
        raise ConfigurationError(
            "trainer.accelerator=cuda but no CUDA device is available; use trainer.accelerator=cpu (or auto)"
        )
    return accelerator


def _positive(cfg: DictConfig, *keys: str) -> None:
    for key in keys:
        value = OmegaConf.select(cfg, key)
        if value is None or value < 1:
            raise ConfigurationError(f"{key} must be at least 1, got {value}")


def validate(cfg: DictConfig, *, launched: bool | None = None) -> None:
    """Semantic checks the schema cannot express. Raises ConfigurationError with the fix.

    Args:
        launched: Whether this process already runs under a launcher (torchrun). Default:
            detected from the environment.
    """
    trainer, strategy = cfg.trainer, cfg.trainer.strategy
    if launched is None:
        launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if strategy.sharding_strategy != "none":
        ShardingStrategy.parse(strategy.sharding_strategy)
    if strategy.cpu_offload:
        raise ConfigurationError(
            "trainer.strategy.cpu_offload=true is not supported yet: shards stay on the training device. "
            "Set trainer.strategy.cpu_offload=false (or use a strategy that shards more: trainer.strategy=fsdp)."
        )
    if strategy.reshard_after_forward not in (None, True, False):
        raise ConfigurationError(
            "trainer.strategy.reshard_after_forward must be true, false or null, "
            f"got {strategy.reshard_after_forward!r}"
        )
    if strategy.state_dict_type not in _STATE_DICT_TYPES:
        raise ConfigurationError(
            f"trainer.strategy.state_dict_type={strategy.state_dict_type!r}; use one of {', '.join(_STATE_DICT_TYPES)}"
        )
    check_precision(trainer.precision)
    if trainer.init_device not in _INIT_DEVICES:
        raise ConfigurationError(f"trainer.init_device={trainer.init_device!r}; use one of {', '.join(_INIT_DEVICES)}")
    _positive(
        cfg,
        "trainer.devices",
        "trainer.num_nodes",
        "trainer.max_steps",
        "trainer.micro_batch_size",
        "trainer.accumulate_grad_batches",
        "trainer.val_check_interval",
        "trainer.val_batches",
        "trainer.log_every_n_steps",
        "data.seq_len",
    )
    if trainer.gradient_clip_val < 0:
        raise ConfigurationError(
            f"trainer.gradient_clip_val must be >= 0 (0 disables), got {trainer.gradient_clip_val}"
        )
    if trainer.collective_timeout_s <= 0:
        raise ConfigurationError(f"trainer.collective_timeout_s must be positive, got {trainer.collective_timeout_s}")
    accelerator = resolve_accelerator(trainer.accelerator)
    if strategy.sharding_strategy == "none" and (trainer.devices > 1 or trainer.num_nodes > 1):
        raise ConfigurationError(
            f"trainer.strategy=single_device runs one process, but trainer.devices={trainer.devices} and "
            f"trainer.num_nodes={trainer.num_nodes}. Use trainer.devices=1, or a distributed strategy "
            "(trainer.strategy=fsdp, zero2 or ddp)."
        )
    if not launched:
        if trainer.num_nodes > 1:
            raise ConfigurationError(
                f"trainer.num_nodes={trainer.num_nodes} needs torchrun on every node (see docs/training.md, "
                "'Several nodes'); without a launcher shardline starts workers on this node only."
            )
        available = torch.cuda.device_count() if accelerator == "cuda" else (os.cpu_count() or 1)
        if trainer.devices > available:
            unit = "CUDA devices" if accelerator == "cuda" else "CPU cores"
            raise ConfigurationError(
                f"trainer.devices={trainer.devices} but this machine has {available} {unit}; "
                f"use trainer.devices={available} or fewer."
            )
    if cfg.model is None or "_target_" not in cfg.model:
        raise ConfigurationError(
            "no model configured: select an experiment (experiment=tiny_gpt) or set model._target_"
        )
    try:
        VerifyLevel.parse(cfg.checkpoint.verify)
    except ConfigurationError as exc:
        raise ConfigurationError(f"checkpoint.verify={cfg.checkpoint.verify!r}: {exc}") from None
    if cfg.checkpoint.every_n_steps < 0:
        raise ConfigurationError(
            f"checkpoint.every_n_steps must be >= 0 (0 disables), got {cfg.checkpoint.every_n_steps}"
        )
    resume = cfg.trainer.resume
    if resume is not None and str(resume) != "auto" and not os.path.isdir(str(resume)):
        raise ConfigurationError(
            f"trainer.resume={resume}: no such checkpoint directory; pass auto or the path of a committed "
            "checkpoint (RUN_DIR/checkpoints/step-N)"
        )
    if cfg.optimizer.lr <= 0:
        raise ConfigurationError(f"optimizer.lr must be positive, got {cfg.optimizer.lr}")
    if not 0 <= cfg.scheduler.min_lr_ratio <= 1:
        raise ConfigurationError(f"scheduler.min_lr_ratio must be within [0, 1], got {cfg.scheduler.min_lr_ratio}")
    if cfg.scheduler.warmup_steps < 0:
        raise ConfigurationError(f"scheduler.warmup_steps must be >= 0, got {cfg.scheduler.warmup_steps}")


def to_yaml(cfg: DictConfig) -> str:
    """The resolved config as YAML (what ``--cfg job`` prints and the run directory keeps)."""
    plain = OmegaConf.to_container(cfg, resolve=True)
    return OmegaConf.to_yaml(OmegaConf.create(plain))
