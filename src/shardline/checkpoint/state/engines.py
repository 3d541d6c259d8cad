"""Which engine sharded a model, and how its state dicts are taken and put back for a checkpoint.

A checkpoint stores the model and optimizer state keyed by the unsharded model's parameter
FQNs whatever sharded the model, so a checkpoint saved by one engine at one world size loads
into another engine at another. :func:`detect_engine` names the engine of a model (one
:class:`Engine`), and this module is the one owner of what differs per engine:

* ``shardline`` (``shardline.wrap``) and ``plain`` (one process, no wrapper): shardline's own
  state dicts (:mod:`.model_state`, :mod:`.optim_state`), unchanged.
* ``fsdp2`` (``torch.distributed.fsdp.fully_shard``, 1-D or a 2-D HSDP mesh), ``fsdp1``
  (``FullyShardedDataParallel``) and ``ddp`` (``DistributedDataParallel``): torch's
  ``torch.distributed.checkpoint.state_dict`` API (``get_state_dict`` / ``set_state_dict``),
  which gives sharded pieces (``DTensor`` / ``ShardedTensor``) under the same FQNs and restores
  them, resharding optimizer state as the engine lays it out.

:func:`describe_sharding` is the manifest's ``sharding`` section: how the shards fit together.

Note: what is refused. A model mixing engines (shardline units inside FSDP, FSDP1 inside
FSDP2...), ``DistributedDataParallel`` anywhere but at the root, and ``DTensor`` parameters
placed by anything but ``fully_shard`` on its data-parallel mesh (tensor parallelism): none of
these is tested, and a checkpoint of them would load wrongly rather than fail. Each is refused
by name before anything is written or read.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.nn.parallel import DistributedDataParallel

from shardline import _torch_compat
from shardline.engine import subtree_units
from shardline.errors import ConfigurationError

__all__ = [
    "Engine",
    "describe_sharding",
    "describe_torch_state",
    "detect_engine",
    "install_torch_state",
    "torch_state",
]


class Engine(str, enum.Enum):
    """What sharded a model (the manifest's ``sharding.engine``)."""

    SHARDLINE = "shardline"
    FSDP2 = "fsdp2"
    FSDP1 = "fsdp1"
    DDP = "ddp"
    PLAIN = "plain"

    @property
    def uses_torch_state_dict(self) -> bool:
        """Whether its state dicts come from ``torch.distributed.checkpoint.state_dict``."""
        return self in (Engine.FSDP2, Engine.FSDP1, Engine.DDP)


_WHAT = {
    Engine.SHARDLINE: "shardline.wrap",
    Engine.FSDP2: "torch fully_shard (FSDP2)",
    Engine.FSDP1: "torch FullyShardedDataParallel (FSDP1)",
    Engine.DDP: "torch DistributedDataParallel",
}


_FSDP1_PREFIX = "_fsdp_wrapped_module."
"""What FSDP1 inserts into module paths; the manifest names modules as the unwrapped model does."""


def _name(path: str) -> str:
    return path or "<root>"


def detect_engine(model: nn.Module) -> Engine:
    """The engine that sharded ``model`` (see the module docstring for what is refused).

    Raises:
        ConfigurationError: a model this module cannot checkpoint, naming the module path and type.
    """
    found: dict[Engine, str] = {}
    for path, module in model.named_modules():
        if isinstance(module, DistributedDataParallel):
            if module is not model:
                raise ConfigurationError(
                    f"module {_name(path)!r} is a DistributedDataParallel inside the model; checkpoints support "
                    "DistributedDataParallel only as the outermost module (wrap the whole model once)"
                )
            found[Engine.DDP] = _name(path)
        elif isinstance(module, FSDPModule):
            found.setdefault(Engine.FSDP2, _name(path))
        elif isinstance(module, FullyShardedDataParallel):
            found.setdefault(Engine.FSDP1, _name(path))
    units = subtree_units(model)
    if units:
        found[Engine.SHARDLINE] = _name(units[0].name)
    if len(found) > 1:
        mixed = "; ".join(f"{_WHAT[e]} at {where!r}" for e, where in found.items())
        raise ConfigurationError(
            f"the model mixes sharding engines ({mixed}); a checkpoint can only say how one engine laid out the "
            "shards: shard the model with one of them"
        )
    engine = next(iter(found), Engine.PLAIN)
    _check_dtensors(model, engine)
    return engine


def _check_dtensors(model: nn.Module, engine: Engine) -> None:
    """Refuse DTensor parameters that ``fully_shard`` did not place on its data-parallel mesh."""
    for fqn, param in model.named_parameters():
        if not isinstance(param, DTensor):
            continue
        placements = tuple(param.placements)
        fits = (
            engine is Engine.FSDP2
            and placements[-1] == Shard(0)
            and all(p == Replicate() for p in placements[:-1])
            and len(placements) <= 2
        )
        if not fits:
            raise ConfigurationError(
                f"parameter {fqn!r} is a DTensor placed {_placements(placements)} on a mesh of shape "
                f"{tuple(param.device_mesh.shape)} under a model sharded by {_WHAT.get(engine, 'no engine')}; "
                "checkpoints support DTensor parameters only as fully_shard places them (Shard(0) on a 1-D mesh, "
                "or Replicate, Shard(0) on a 2-D HSDP mesh), not tensor parallelism"
            )


def _placements(placements: tuple[Any, ...]) -> str:
    return ", ".join(repr(p) for p in placements)


def _options(*, full: bool, strict: bool = True) -> StateDictOptions:
    return StateDictOptions(full_state_dict=full, cpu_offload=full, strict=strict)


def torch_state(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, *, full: bool = False
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """``(model state dict, optimizer state dict or None)`` from torch's state-dict API.

    Keys are FQNs without wrapper prefixes (``module.``, ``_fsdp_wrapped_module.``); sharded
    tensors are ``DTensor`` (FSDP2) or ``ShardedTensor`` (FSDP1) pieces sharing memory with the
    model. ``full`` gathers to CPU on rank 0 (a collective; other ranks get empty dicts). An
    optimizer without state yet gets it initialized first (torch's zero-learning-rate step), so
    a fresh one can be loaded into.
    """
    options = _options(full=full)
    if optimizer is None:
        return get_model_state_dict(model, options=options), None
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    return model_sd, dict(optim_sd)


def install_torch_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    model_sd: Mapping[str, Any],
    optim_sd: Mapping[str, Any] | None,
    *,
    strict: bool = True,
) -> None:
    """Put state dicts of :func:`torch_state`'s layout back into the model (and optimizer) with torch's API."""
    options = _options(full=False, strict=strict)
    if optimizer is None or optim_sd is None:
        set_model_state_dict(model, dict(model_sd), options=options)
        return
    set_state_dict(model, optimizer, model_state_dict=dict(model_sd), optim_state_dict=dict(optim_sd), options=options)


def _dtype(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def _json_policy(policy: Any) -> dict[str, Any] | None:
    """A mixed-precision policy dataclass as JSON data (dtypes by name)."""
    if policy is None or not dataclasses.is_dataclass(policy):
        return None
    out: dict[str, Any] = {}
    for field in dataclasses.fields(policy):
        if field.name.startswith("_"):
            continue
        value = getattr(policy, field.name)
        if isinstance(value, torch.dtype) or value is None:
            out[field.name] = _dtype(value)
        elif isinstance(value, (bool, int, str)):
            out[field.name] = value
        else:
            out[field.name] = str(value)
    return out


def describe_sharding(model: nn.Module, engine: Engine) -> dict[str, Any]:
    """The manifest's ``sharding`` section: which engine laid out the shards, and how (plain JSON data).

    ``fsdp2``: the mesh (shape, dim names), each parameter's placements, and per ``fully_shard``
    module ``reshard_after_forward`` and the mixed-precision policy. ``fsdp1``: per wrapped
    module the sharding strategy, mixed precision and ``use_orig_params``, and the state-dict
    type saved. ``ddp`` / ``plain``: parameters replicated. ``shardline``: the engine only (its
    units are the manifest's ``units``).
    """
    if engine is Engine.FSDP2:
        return _describe_fsdp2(model)
    if engine is Engine.FSDP1:
        modules: dict[str, Any] = {}
        for path, module in model.named_modules():
            if isinstance(module, FullyShardedDataParallel):
                strategy = module.sharding_strategy
                modules[_name(path.replace(_FSDP1_PREFIX, ""))] = {
                    "sharding_strategy": strategy.name if strategy is not None else None,
                    "mixed_precision": _json_policy(module.mixed_precision),
                    "use_orig_params": bool(getattr(module, "_use_orig_params", False)),
                }
        return {"engine": engine.value, "state_dict_type": "SHARDED_STATE_DICT", "modules": modules}
    if engine in (Engine.DDP, Engine.PLAIN):
        return {"engine": engine.value, "parameters": "replicated"}
    return {"engine": engine.value}


def _describe_fsdp2(model: nn.Module) -> dict[str, Any]:
    parameters: dict[str, str] = {}
    mesh: dict[str, Any] | None = None
    for fqn, param in model.named_parameters():
        if isinstance(param, DTensor):
            parameters[fqn] = _placements(tuple(param.placements))
            if mesh is None:
                names = param.device_mesh.mesh_dim_names
                mesh = {"shape": list(param.device_mesh.shape), "dim_names": list(names) if names else None}
        else:
            parameters[fqn] = "not sharded"
    modules: dict[str, Any] = {}
    for path, module in model.named_modules():
        if isinstance(module, FSDPModule):
            reshard, policy = _torch_compat.fsdp2_settings(module)
            modules[_name(path)] = {"reshard_after_forward": reshard, "mixed_precision": _json_policy(policy)}
    return {"engine": Engine.FSDP2.value, "mesh": mesh, "parameters": parameters, "modules": modules}


def describe_torch_state(model: nn.Module, model_sd: Mapping[str, Any]) -> dict[str, Any]:
    """The manifest's ``model`` record for a state dict of :func:`torch_state` (as ``describe_model`` gives it).

    Shapes are global (the unsharded model's); ``tied`` is empty (torch's API lists a tied
    parameter under its first name only).
    """
    params = _torch_compat.parameter_fqns(model)
    state = {key: [list(value.shape), _dtype(value.dtype)] for key, value in model_sd.items()}
    numels = {key: int(torch.Size(value.shape).numel()) for key, value in model_sd.items() if key in params}
    return {
        "tensors": len(state),
        "parameters": sum(numels.values()),
        "tied": [],
        "scalars": sorted(key for key, value in model_sd.items() if key in params and tuple(value.shape) == ()),
        "state": state,
    }
