"""Model state dicts of a sharded model in three kinds: sharded (DTensor pieces), full, local.

* **sharded**: each parameter is this rank's piece as a ``DTensor`` (``Shard(0)`` for sharded
  units, ``Replicate()`` for NO_SHARD) sharing memory with the live shard; buffers are plain
  tensors. No communication. This is what a checkpoint stores: DCP reshards it on load.
* **full**: every parameter gathered to its full shape, unit by unit, on rank 0 only, on CPU
  (``shardline.full_state_dict(rank0_only=True)``). A collective.
* **local**: this rank's raw shard tensors (``torch.chunk`` rows), for debugging. No
  communication; loading one back needs the same world size and strategies.

Keys are the unsharded model's ``state_dict()`` keys in every kind. A 0-d parameter appears
with shape ``(1,)`` in the sharded and local kinds (the engine's layout) and ``()`` in full.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from shardline.engine.param import ShardedParam
from shardline.engine.state import subtree_units
from shardline.engine.state_dict import full_state_dict, key_problems, load_full_state_dict
from shardline.engine.unit import ShardUnit
from shardline.errors import CheckpointMismatchError, ConfigurationError

__all__ = [
    "KINDS",
    "StateDictKind",
    "as_dtensor",
    "check_kind",
    "load_model_state_dict",
    "model_state_dict",
    "param_index",
    "reshard_all",
    "state_shape",
]

StateDictKind = Literal["sharded", "full", "local"]
KINDS: tuple[str, ...] = ("sharded", "full", "local")
_SHOW = 10


def check_kind(kind: str) -> StateDictKind:
    """Validate a state-dict kind name."""
    if kind not in KINDS:
        raise ConfigurationError(f"unknown state-dict kind {kind!r}; choose one of {', '.join(KINDS)}")
    return kind  # type: ignore[return-value]


def param_index(model: nn.Module) -> dict[int, tuple[ShardUnit, ShardedParam]]:
    """``id(tensor) -> (unit, sharded param)`` for the shard and the gathered tensor of every managed parameter."""
    index: dict[int, tuple[ShardUnit, ShardedParam]] = {}
    for unit in subtree_units(model):
        for sp in unit.params:
            index[id(sp.sharded)] = (unit, sp)
            if sp.unsharded is not None:
                index[id(sp.unsharded)] = (unit, sp)
    return index


def buffer_dtypes(model: nn.Module) -> dict[int, torch.dtype]:
    """``id(buffer) -> original dtype`` for buffers that ``MixedPrecision.buffer_dtype`` cast."""
    return {
        id(m._buffers[name]): dtype
        for unit in subtree_units(model)
        for (m, name), dtype in unit.buffer_dtypes.items()
        if m._buffers.get(name) is not None
    }


def state_shape(sp: ShardedParam) -> tuple[int, ...]:
    """Global shape of ``sp`` as DTensors and optimizer state show it: its shape, ``(1,)`` for 0-d."""
    return (sp.layout.rows, *sp.layout.row_shape)


def as_dtensor(unit: ShardUnit, sp: ShardedParam, local: torch.Tensor) -> DTensor:
    """``local`` (shaped like ``sp``'s shard) as a DTensor placed like ``unit.to_dtensor(sp)``, sharing memory."""
    if tuple(local.shape) != sp.layout.local_shape:
        raise CheckpointMismatchError(
            f"tensor of shape {tuple(local.shape)} cannot be placed like parameter '{sp.fqn}' of unit "
            f"{unit.display_name!r}, whose local shard has shape {sp.layout.local_shape}"
        )
    shape = state_shape(sp)
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    placement = Shard(0) if unit.mesh.shard_size > 1 else Replicate()
    return DTensor.from_local(
        local,
        unit.mesh.device_mesh_for(local.device.type),
        [placement],
        run_check=False,
        shape=torch.Size(shape),
        stride=tuple(reversed(stride)),
    )


def reshard_all(model: nn.Module) -> None:
    """Free gathered parameters of every unit, so loads write shards that nothing stale shadows."""
    for unit in subtree_units(model):
        unit.pinned = False
        unit.reshard()


def model_state_dict(model: nn.Module, *, kind: StateDictKind = "sharded") -> dict[str, Any]:
    """The model's state dict of the given kind (see the module docstring).

    ``full`` is a collective (every rank must call it) and returns an empty dict on ranks other
    than 0; ``sharded`` and ``local`` need no communication and share memory with the model.
    """
    check_kind(kind)
    if kind == "full":
        return full_state_dict(model, rank0_only=True, cpu_offload=True)
    index = param_index(model)
    original = buffer_dtypes(model)
    out: dict[str, Any] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        found = index.get(id(value))
        if found is None:
            tensor = value.detach()
            out[key] = tensor.to(original[id(value)]) if id(value) in original else tensor
            continue
        unit, sp = found
        out[key] = unit.to_dtensor(sp) if kind == "sharded" else sp.sharded.detach()
    return out


def _mismatch(problems: list[str], what: str) -> CheckpointMismatchError:
    shown = "; ".join(problems[:_SHOW]) + (f"; ... ({len(problems) - _SHOW} more)" if len(problems) > _SHOW else "")
    return CheckpointMismatchError(
        f"the {what} does not fit the model -- {shown}. It must come from the same model architecture; "
        "resharding across world sizes or strategies goes through shardline.checkpoint.save/load."
    )


def load_model_state_dict(
    model: nn.Module, state_dict: Mapping[str, Any] | None, *, kind: StateDictKind = "sharded", strict: bool = True
) -> None:
    """Load a state dict of the given kind back into ``model``.

    ``full`` is a collective: rank 0 passes the dict (other ranks may pass ``None``) and every
    rank receives its rows. ``sharded`` and ``local`` copy each rank's own pieces and need the
    same world size and strategies as when the dict was taken (DTensor pieces of another
    layout are rejected: use a checkpoint to reshard).

    Raises:
        CheckpointMismatchError: missing or unexpected keys (with ``strict``), or shapes/layouts
            that differ; raised before anything is written.
    """
    check_kind(kind)
    if kind == "full":
        load_full_state_dict(model, state_dict, strict=strict, broadcast_from_rank0=True)
        return
    if state_dict is None:
        raise ConfigurationError(f"load_model_state_dict(kind={kind!r}) needs the state dict on every rank, got None")
    index = param_index(model)
    local = model.state_dict(keep_vars=True)
    problems: list[str] = key_problems(local, state_dict) if strict else []
    plan: list[tuple[torch.Tensor, torch.Tensor]] = []
    for key, target in local.items():
        if key not in state_dict:
            continue
        value = state_dict[key]
        found = index.get(id(target))
        if found is None:
            if tuple(value.shape) != tuple(target.shape):
                problems.append(f"{key}: given {tuple(value.shape)} vs model {tuple(target.shape)}")
            else:
                plan.append((target, value.to_local() if isinstance(value, DTensor) else value))
            continue
        _, sp = found
        piece = value
        if kind == "sharded":
            if not isinstance(value, DTensor):
                problems.append(f"{key}: expected a DTensor piece (sharded kind), got {type(value).__name__}")
                continue
            if tuple(value.shape) != state_shape(sp):
                problems.append(f"{key}: given {tuple(value.shape)} vs model {state_shape(sp)}")
                continue
            piece = value.to_local()
        if tuple(piece.shape) != sp.layout.local_shape:
            problems.append(
                f"{key}: local piece {tuple(piece.shape)} vs this rank's shard {sp.layout.local_shape} "
                "(taken at another world size or strategy)"
            )
            continue
        plan.append((sp.sharded, piece))
    if problems:
        raise _mismatch(problems, f"{kind} model state dict")
    reshard_all(model)
    with torch.no_grad():
        for target, value in plan:
            target.data.copy_(value.to(device=target.device, dtype=target.dtype))
