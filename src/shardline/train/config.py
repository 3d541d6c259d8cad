"""Compose and validate the ``shardline train`` config: YAML layers + overrides onto typed schemas.

:func:`compose_config` gives the composed ``DictConfig`` (what ``--cfg job`` prints);
:func:`to_train_config` turns it into the typed :class:`~shardline.train.schema.TrainConfig`
that everything after it takes -- the checks, the launcher, every worker -- and :func:`validate`
checks what the schema cannot express. Every failure becomes one
:class:`~shardline.errors.ConfigurationError` whose message names the offending key or value and
what is allowed, raised before any worker starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import yaml
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

from shardline.checkpoint.lifecycle.manager import is_auto_resume
from shardline.checkpoint.provenance.retention import RetentionPolicy
from shardline.checkpoint.storage.stores import local_path
from shardline.engine import ShardingStrategy, hybrid_degrees
from shardline.errors import ConfigurationError, error_chain
from shardline.train.best_checkpoints import check_best_k
from shardline.train.config_layers import (
    DEFAULT_EXPERIMENT,
    ConfigPlan,
    apply_model_replacement,
    prepare,
    strategy_selection,
    suggest,
)
from shardline.train.data.sources import check_data_config
from shardline.train.redaction import redact_config
from shardline.train.schema import ACCELERATORS, TrainConfig, register_schemas
from shardline.train.strategy_keys import foreign_key_reason

__all__ = [
    "CONFIG_MODULE",
    "DEFAULT_EXPERIMENT",
    "compose_config",
    "experiment_name",
    "launched_world_size",
    "shard_degrees",
    "to_train_config",
    "to_yaml",
    "validate",
]

CONFIG_MODULE = "shardline.train.conf"

# "trainer.strategy=fsdp" reads naturally and is what Lightning+Hydra users type; in Hydra it
# would assign a string to the strategy node. A bare name selects the trainer_strategy group --
# a file's name, or any sharding-strategy name or alias (config_layers.strategy_selection).
_STRATEGY_SELECT = re.compile(r"^(?:trainer\.strategy|trainer_strategy)=([A-Za-z_][A-Za-z0-9_-]*)$")


_TAG_PREFIX = "tracking.tags."


def rewrite_overrides(overrides: Sequence[str], config_dirs: Sequence[str | Path] = ()) -> list[str]:
    """Turn ``trainer.strategy=NAME`` into the group selection ``trainer_strategy=FILE``, and a run tag
    ``tracking.tags.KEY=VALUE`` into ``++tracking.tags.KEY=VALUE`` (adds it, or replaces the YAML's).

    ``NAME`` is a strategy file's name or a sharding-strategy name or alias (``zero3``,
    ``full_shard``, ``shard_grad_op``...), which selects the shipped file that sets it.
    """
    out = []
    for override in overrides:
        match = _STRATEGY_SELECT.match(override)
        if match:
            out.append(f"trainer_strategy={strategy_selection(match.group(1), config_dirs)}")
        elif override.startswith(_TAG_PREFIX):
            # Note: tracking.tags is a free mapping, which Hydra's struct mode would refuse a new key of without
            # the "+" it does not ask for elsewhere; "++" adds the tag or replaces the YAML's value of it.
            out.append("++" + override)
        else:
            out.append(override)
    return out


def experiment_name(overrides: Sequence[str]) -> str:
    """The experiment(s) selected by the overrides, joined with '+' (default: tiny_gpt).

    An experiment given as a file path counts by its file name without the extension, so
    ``experiment=configs/my_lm.yaml`` files runs under ``runs/my_lm/``.
    """
    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except OverrideParseException:
        return DEFAULT_EXPERIMENT
    for override in parsed:
        if override.key_or_group == "experiment" and not override.is_delete():
            value = override.value()
            names = value if isinstance(value, list) else [value]
            stems = [Path(str(n)).stem if str(n).endswith((".yaml", ".yml")) else str(n) for n in names]
            return "+".join(stems) or DEFAULT_EXPERIMENT
    return DEFAULT_EXPERIMENT


def compose_config(overrides: Sequence[str] = (), *, config_dirs: Sequence[str | Path] = ()) -> DictConfig:
    """The fully composed, schema-checked config for ``overrides`` (Hydra override syntax).

    Args:
        overrides: ``key=value``, ``++key=value``, ``~key``, ``experiment=NAME|PATH.yaml|[A,B]``...
        config_dirs: Folders with more ``experiment/`` and ``trainer_strategy/`` YAML files
            (``shardline train --config-dir DIR``).
    """
    register_schemas()
    with prepare(rewrite_overrides(overrides, config_dirs), config_dirs) as plan:
        try:
            cfg = _compose(plan.overrides)
        except (yaml.YAMLError, *_HYDRA_ERRORS) as exc:
            bad_yaml = next((e for e in error_chain(exc) if isinstance(e, yaml.YAMLError)), None)
            if bad_yaml is not None:
                raise ConfigurationError(plan.yaml_error(bad_yaml)) from None
            raise ConfigurationError(_explain(exc, plan)) from None
        apply_model_replacement(cfg, plan)
    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as exc:
        raise ConfigurationError(f"cannot resolve an interpolation in the config: {_first_line(exc)}") from None
    return cfg


_HYDRA_ERRORS = (ConfigCompositionException, MissingConfigException, OverrideParseException, OmegaConfBaseException)


def to_train_config(cfg: DictConfig) -> TrainConfig:
    """The composed config as a typed :class:`TrainConfig` (the schema's enumerated settings checked).

    Nodes the schema leaves free-form (``model``, the strategy's policies and mixed precision,
    ``callbacks``: ``_target_`` nodes) become plain dicts and lists, built where they are used.

    Raises:
        ConfigurationError: a setting outside its choices (naming the key, the value and the choices), or a
            key the schema does not have (added with ``+``), with the reason when it is a torch FSDP strategy key.
    """
    _check_schema_keys(cfg)
    try:
        config = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as exc:
        raise ConfigurationError(f"the config does not fit its schema: {_first_line(exc)}") from None
    if not isinstance(config, TrainConfig):
        raise ConfigurationError(
            f"the config is not a shardline train config (got {type(config).__name__}); compose it with compose_config"
        )
    return config


def _check_schema_keys(cfg: DictConfig) -> None:
    """Refuse keys the schema lacks, anywhere it is typed (``+`` adds them past struct mode).

    Free-form nodes (``model``, ``callbacks``, the strategy's policies, ``storage_options``,
    ``tracking.tags``) take any key; every node the schema types takes only its fields, so a
    misspelt ``+trainer.max_step=10`` fails instead of being ignored.
    """
    _check_node(cfg, [])


def _check_node(node: DictConfig, path: list[str]) -> None:
    allowed = _schema_fields(path) if path else [f.name for f in dataclasses.fields(TrainConfig)]
    if allowed is None:
        return
    where = ".".join(path)
    for name, child in node.items_ex(resolve=False):  # no interpolation resolved; a missing value stays "???"
        key = str(name)
        if key not in allowed:
            full = f"{where}.{key}" if where else key
            reason = foreign_key_reason(key) if path == ["trainer", "strategy"] else None
            if reason is not None:
                raise ConfigurationError(reason)
            close = difflib.get_close_matches(key, allowed, n=1)
            hint = f" Did you mean '{where + '.' if where else ''}{close[0]}'?" if close else ""
            raise ConfigurationError(
                f"unknown config key '{full}'.{hint} Allowed keys under '{where or 'the config root'}': "
                f"{', '.join(allowed)}."
            )
        if isinstance(child, DictConfig):
            _check_node(child, [*path, key])


def _compose(overrides: list[str]) -> DictConfig:
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
            return compose(config_name="config", overrides=overrides)
    finally:
        GlobalHydra.instance().clear()


def _keys_without(plan: ConfigPlan, full_key: str) -> list[str]:
    """Keys of the node holding ``full_key`` when composed without the overrides that set it (for a hint)."""
    node_path, _, _ = full_key.rpartition(".")
    kept = [o for o in plan.overrides if o.lstrip("+~").partition("=")[0] != full_key]
    try:
        node = OmegaConf.select(_compose(kept), node_path)
    except _HYDRA_ERRORS:
        return []
    return [str(k) for k in node] if isinstance(node, DictConfig) else []


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
        factory = types[part].default_factory
        default = factory if callable(factory) else None  # MISSING (no factory) is not callable
        node = default() if default is not None else None
    if dataclasses.is_dataclass(node):
        return [f.name for f in dataclasses.fields(node)]
    return None


def _key_error(
    cause: BaseException | None,
) -> ConfigKeyError | ConfigAttributeError | ValidationError | None:
    """The OmegaConf key/validation error behind a Hydra error (chained as cause or context)."""
    seen = 0
    while cause is not None and seen < 8:
        if isinstance(cause, (ConfigKeyError, ConfigAttributeError, ValidationError)) and getattr(
            cause, "full_key", None
        ):
            return cause
        cause = cause.__cause__ or cause.__context__
        seen += 1
    return None


def _explain(exc: BaseException, plan: ConfigPlan) -> str:
    if isinstance(exc, MissingConfigException):
        text = str(exc)
        missing = re.search(r"Could not find '([^'/]+)/([^']+)'", text)
        options = [o for o in re.findall(r"^\t(\S+)$", text, flags=re.M) if not o.startswith("_file")]
        if missing:
            group, name = missing.groups()
            key = "trainer.strategy" if group == "trainer_strategy" else group
            if group == "trainer_strategy":
                aliases = sorted(set(ShardingStrategy.vocabulary()) - set(options))
                return (
                    f"unknown trainer strategy {name!r}"
                    + suggest(name, [*options, *aliases])
                    + f"; available: {', '.join(options)}, or a sharding-strategy name ({', '.join(aliases)}). "
                    "Pass trainer.strategy=NAME with one of them."
                )
            return (
                f"unknown {key.replace('_', ' ')} {name!r}"
                + suggest(name, options)
                + f"; available: {', '.join(options)}. Pass {key}=NAME with one of them"
                + (", or the path of a YAML file (experiment=path/to/file.yaml)." if group == "experiment" else ".")
            )
        return _first_line(exc)
    if isinstance(exc, OverrideParseException):
        return f"cannot parse the command-line overrides: {_first_line(exc)} (Hydra override syntax: key=value)"
    where = re.match(r"In '([^']+)'", str(exc))
    source = f" (set in {plan.describe(where.group(1))})" if where else ""
    cause = _key_error(exc)
    if cause is not None:
        full_key = str(cause.full_key)
        parts = full_key.split(".")
        if isinstance(cause, (ConfigKeyError, ConfigAttributeError)):
            if where and parts[0] in ("experiment", "trainer_strategy"):
                return (
                    f"unknown config key '{full_key}'{source}: the file was placed under '{parts[0]}'. Start an "
                    "experiment file with the line '# @package _global_' (and a strategy file with "
                    "'# @package trainer.strategy')."
                )
            foreign = foreign_key_reason(parts[-1]) if parts[:-1] == ["trainer", "strategy"] else None
            if foreign is not None:
                return foreign + (f" (set in {plan.describe(where.group(1))})" if where else "")
            allowed = _schema_fields(parts[:-1])
            if allowed is not None:
                close = difflib.get_close_matches(parts[-1], allowed, n=1)
                prefix = ".".join(parts[:-1])
                hint = f" Did you mean '{prefix + '.' if prefix else ''}{close[0]}'?" if close else ""
                return (
                    f"unknown config key '{full_key}'{source}.{hint} Allowed keys under '{prefix or '<root>'}': "
                    f"{', '.join(allowed)}."
                )
            if not where and len(parts) > 1:
                existing = _keys_without(plan, full_key)
                close = difflib.get_close_matches(parts[-1], existing, n=1)
                if close:
                    prefix = ".".join(parts[:-1])
                    return (
                        f"unknown config key '{full_key}'. Did you mean '{prefix}.{close[0]}'? Keys under "
                        f"'{prefix}': {', '.join(existing)} (add a new one with +{full_key}=VALUE)."
                    )
                return (
                    f"unknown config key '{full_key}': '{'.'.join(parts[:-1])}' has no key '{parts[-1]}' yet; add "
                    f"one with a leading '+' (+{full_key}=VALUE), or set it whether or not it exists with "
                    f"'++' (++{full_key}=VALUE)"
                )
            return f"unknown config key '{full_key}'{source}"
        return f"invalid value for '{full_key}'{source}: {_first_line(cause)}"
    inner = exc.__cause__ or exc.__context__
    return _first_line(exc) + (f": {_first_line(inner)}" if inner is not None and inner is not exc else "")


def resolve_accelerator(accelerator: str) -> str:
    """``auto`` -> cuda when available, else cpu; cuda when unavailable is an error."""
    if accelerator not in ACCELERATORS:
        raise ConfigurationError(f"trainer.accelerator={accelerator!r}; use one of {', '.join(ACCELERATORS)}")
    if accelerator == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if accelerator == "cuda" and not torch.cuda.is_available():
        raise ConfigurationError(
            "trainer.accelerator=cuda but no CUDA device is available; use trainer.accelerator=cpu (or auto)"
        )
    return accelerator


def _positive(cfg: TrainConfig, *keys: str) -> None:
    for key in keys:
        value: Any = cfg
        for part in key.split("."):
            value = getattr(value, part)
        if value is None or value < 1:
            raise ConfigurationError(f"{key} must be at least 1, got {value}")


def validate(cfg: TrainConfig, *, launched: bool | None = None) -> None:
    """Semantic checks the schema cannot express (ranges, the machine, files). Raises ConfigurationError with the fix.

    The enumerated settings were checked when the config became a :class:`TrainConfig`
    (:func:`to_train_config`).

    Args:
        launched: Whether this process already runs under a launcher (torchrun). Default:
            detected from the environment.
    """
    trainer, strategy = cfg.trainer, cfg.trainer.strategy
    if launched is None:
        launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    parsed = strategy.sharding
    if strategy.cpu_offload and (parsed is None or (parsed.policy.shard_optimizer and not parsed.policy.shard_params)):
        raise ConfigurationError(
            f"trainer.strategy.cpu_offload=true needs a strategy with sharded parameters (fsdp, zero2, hsdp, "
            f"hsdp_zero2) or ddp, got sharding_strategy={strategy.sharding_strategy!r}: "
            + (
                "a single-device run is not sharded, so there is no shard to keep on the host."
                if parsed is None
                else "ZeRO-1 keeps whole parameters on every rank and updates them on the device."
            )
            + " Pick one of those strategies (trainer.strategy=fsdp), or set trainer.strategy.cpu_offload=false."
        )
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
    _check_mesh(cfg, parsed)
    if trainer.gradient_clip_val < 0:
        raise ConfigurationError(
            f"trainer.gradient_clip_val must be >= 0 (0 disables), got {trainer.gradient_clip_val}"
        )
    if trainer.collective_timeout_s <= 0:
        raise ConfigurationError(f"trainer.collective_timeout_s must be positive, got {trainer.collective_timeout_s}")
    if trainer.preemption_grace_s <= 0:
        raise ConfigurationError(
            f"trainer.preemption_grace_s must be positive (seconds to save after SIGTERM), got "
            f"{trainer.preemption_grace_s}"
        )
    if trainer.global_batch_size < 0:
        raise ConfigurationError(
            f"trainer.global_batch_size must be >= 0 (0: micro_batch_size x accumulate_grad_batches x world size), "
            f"got {trainer.global_batch_size}"
        )
    accelerator = resolve_accelerator(trainer.accelerator)
    if strategy.sharding is None and (trainer.devices > 1 or trainer.num_nodes > 1):
        raise ConfigurationError(
            f"trainer.strategy=single_device runs one process, but trainer.devices={trainer.devices} and "
            f"trainer.num_nodes={trainer.num_nodes}. Use trainer.devices=1, or a distributed strategy "
            "(trainer.strategy=fsdp, zero2, zero1, ddp or hsdp)."
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
    if not isinstance(cfg.model, dict) or "_target_" not in cfg.model:
        raise ConfigurationError(
            "no model configured: select an experiment (experiment=tiny_gpt) or set model._target_"
        )
    if cfg.checkpoint.every_n_steps < 0:
        raise ConfigurationError(
            f"checkpoint.every_n_steps must be >= 0 (0 disables), got {cfg.checkpoint.every_n_steps}"
        )
    RetentionPolicy(keep_last_n=cfg.checkpoint.keep_last_n)  # a negative count is an error before any worker starts
    check_best_k(cfg)
    resume = cfg.trainer.resume
    local = local_path(str(resume)) if resume is not None and not is_auto_resume(resume) else None
    if local is not None and not local.is_dir():  # a URL is checked with the run's credentials, by the launcher
        raise ConfigurationError(
            f"trainer.resume={resume}: no such checkpoint directory; pass auto, the path of a committed "
            "checkpoint (RUN_DIR/checkpoints/step-N), or its URL (s3://BUCKET/PREFIX/step-N)"
        )
    check_data_config(cfg.data)
    if cfg.optimizer.lr <= 0:
        raise ConfigurationError(f"optimizer.lr must be positive, got {cfg.optimizer.lr}")
    if not 0 <= cfg.scheduler.min_lr_ratio <= 1:
        raise ConfigurationError(f"scheduler.min_lr_ratio must be within [0, 1], got {cfg.scheduler.min_lr_ratio}")
    if cfg.scheduler.warmup_steps < 0:
        raise ConfigurationError(f"scheduler.warmup_steps must be >= 0, got {cfg.scheduler.warmup_steps}")


def launched_world_size(cfg: TrainConfig) -> int:
    """Ranks of the job: torchrun's ``WORLD_SIZE`` under a launcher (it changes on an elastic restart), else
    ``trainer.devices x trainer.num_nodes``."""
    env = os.environ.get("WORLD_SIZE", "")
    if "RANK" in os.environ and env.isdigit():
        return int(env)
    return cfg.trainer.devices * cfg.trainer.num_nodes


def shard_degrees(cfg: TrainConfig, *, world_size: int | None = None) -> tuple[int, int]:
    """``(replicate_size, shard_size)`` of the run: a hybrid strategy's degrees, else (1, world) or (world, 1).

    ``world_size`` defaults to :func:`launched_world_size`: after an elastic restart at another size a hybrid
    strategy's free degree (-1) is re-derived, and fixed degrees that no longer fit are refused.
    """
    strategy = cfg.trainer.strategy
    world = launched_world_size(cfg) if world_size is None else world_size
    parsed = strategy.sharding
    if parsed is None:
        return 1, 1
    if parsed.policy.hybrid:
        return hybrid_degrees(world_size=world, replicate_size=strategy.replicate_size, shard_size=strategy.shard_size)
    return (1, world) if parsed.policy.shard_optimizer else (world, 1)


def _check_mesh(cfg: TrainConfig, parsed: ShardingStrategy | None) -> None:
    """Hybrid degrees multiply to the world size; only hybrid strategies take them; an int reshard divides the group."""
    strategy = cfg.trainer.strategy
    hybrid = parsed is not None and parsed.policy.hybrid
    if not hybrid and (strategy.replicate_size != -1 or strategy.shard_size != -1):
        raise ConfigurationError(
            f"trainer.strategy.replicate_size={strategy.replicate_size} and shard_size={strategy.shard_size} only "
            f"apply to hybrid sharding, but the strategy is {strategy.sharding_strategy}. Use trainer.strategy=hsdp, "
            "or leave both at -1."
        )
    if hybrid:
        try:
            shard_degrees(cfg)
        except ConfigurationError as exc:
            world = launched_world_size(cfg)
            where = (
                f"world size {world} from the launcher (torchrun's WORLD_SIZE; an elastic restart changes it)"
                if world != cfg.trainer.devices * cfg.trainer.num_nodes
                else f"world size = trainer.devices={cfg.trainer.devices} x trainer.num_nodes={cfg.trainer.num_nodes}"
            )
            raise ConfigurationError(
                f"trainer.strategy: {exc} ({where}; set trainer.strategy.replicate_size and "
                "trainer.strategy.shard_size, or leave one at -1 to derive it)"
            ) from None
    raf = strategy.reshard_after_forward
    if isinstance(raf, int) and not isinstance(raf, bool) and parsed is not None:
        shard = shard_degrees(cfg)[1]
        if not parsed.policy.shard_params or shard % raf:
            divisors = [d for d in range(1, shard + 1) if shard % d == 0]
            raise ConfigurationError(
                f"trainer.strategy.reshard_after_forward={raf} must divide the shard group's size {shard} of "
                f"{strategy.sharding_strategy} (valid: {divisors if parsed.policy.shard_params else 'none'}; "
                "the strategy must shard parameters: fsdp, zero2 or hsdp)"
            )


def to_yaml(cfg: DictConfig | TrainConfig) -> str:
    """The resolved config as YAML (what ``--cfg job`` prints and the run directory keeps as ``config.yaml``)."""
    plain = cfg.to_dict() if isinstance(cfg, TrainConfig) else OmegaConf.to_container(cfg, resolve=True)
    if isinstance(plain, dict):
        plain = redact_config({str(k): v for k, v in plain.items()})
    return OmegaConf.to_yaml(OmegaConf.create(plain))
