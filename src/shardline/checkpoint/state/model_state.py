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
from typing import Any, Literal, get_args

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from shardline.checkpoint.coordination import coord
from shardline.engine import full_state_dict, load_full_state_dict
from shardline.engine._checkpoint_support import (
    ManagedParam,
    buffer_original_dtypes,
    key_problems,
    managed_parameters,
    registered_state_dict,
    release_all,
)
from shardline.errors import CheckpointMismatchError, ConfigurationError

__all__ = [
    "KINDS",
    "SAVE_KINDS",
    "SaveKind",
    "StateDictKind",
    "check_kind",
    "load_model_state_dict",
    "model_state_dict",
    "param_index",
]

SaveKind = Literal["sharded", "full"]
"""The kinds a checkpoint is saved in: ``sharded`` (each rank writes its shards; reshardable) or ``full`` (gathered)."""
SAVE_KINDS: tuple[str, ...] = get_args(SaveKind)
StateDictKind = Literal[SaveKind, "local"]
"""Every kind of model state dict: the save kinds, and ``local`` (raw shards, for in-memory debugging)."""
KINDS: tuple[str, ...] = get_args(StateDictKind)
_SHOW = 10


def check_kind(kind: str) -> StateDictKind:
    """Validate a state-dict kind name."""
    if kind not in KINDS:
        raise ConfigurationError(f"unknown state-dict kind {kind!r}; choose one of {', '.join(KINDS)}")
    return kind  # type: ignore[return-value]


def param_index(model: nn.Module) -> dict[int, ManagedParam]:
    """``id(tensor) -> ManagedParam`` for the shard and the gathered tensor of every managed parameter."""
    return managed_parameters(model)


def model_state_dict(model: nn.Module, *, kind: StateDictKind = "sharded") -> dict[str, Any]:
    """The model's state dict of the given kind (see the module docstring).

    ``full`` is a collective (every rank must call it) and returns an empty dict on ranks other
    than 0; ``sharded`` and ``local`` need no communication and share memory with the model.
    """
    check_kind(kind)
    if kind == "full":
        held: dict[str, dict[str, Any]] = {}

        def gather() -> None:
            held["full"] = full_state_dict(model, rank0_only=True, cpu_offload=True)

        # Host memory may run out on rank 0 alone; it raises after the last gather, and every rank learns it
        # here, before anything else is gathered.
        coord.all_succeed(gather, None, what="gather the full model state dict")
        return held["full"]
    index = param_index(model)
    original = buffer_original_dtypes(model)
    out: dict[str, Any] = {}
    for key, value in registered_state_dict(model).items():
        handle = index.get(id(value))
        if handle is None:
            tensor = value.detach()
            out[key] = tensor.to(original[id(value)]) if id(value) in original else tensor
            continue
        out[key] = handle.to_dtensor() if kind == "sharded" else handle.shard.detach()
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
    local = registered_state_dict(model)
    problems: list[str] = key_problems(local, state_dict) if strict else []
    plan: list[tuple[torch.Tensor, torch.Tensor]] = []
    for key, target in local.items():
        if key not in state_dict:
            continue
        value = state_dict[key]
        handle = index.get(id(target))
        if handle is None:
            if tuple(value.shape) != tuple(target.shape):
                problems.append(f"{key}: given {tuple(value.shape)} vs model {tuple(target.shape)}")
            else:
                plan.append((target, value.to_local() if isinstance(value, DTensor) else value))
            continue
        piece = value
        if kind == "sharded":
            if not isinstance(value, DTensor):
                problems.append(f"{key}: expected a DTensor piece (sharded kind), got {type(value).__name__}")
                continue
            if tuple(value.shape) != handle.global_shape:
                problems.append(f"{key}: given {tuple(value.shape)} vs model {handle.global_shape}")
                continue
            piece = value.to_local()
        if tuple(piece.shape) != handle.local_shape:
            problems.append(
                f"{key}: local piece {tuple(piece.shape)} vs this rank's shard {handle.local_shape} "
                "(taken at another world size or strategy)"
            )
            continue
        plan.append((handle.shard, piece))
    if problems:
        raise _mismatch(problems, f"{kind} model state dict")
    release_all(model)
    with torch.no_grad():
        for target, value in plan:
            target.data.copy_(value.to(device=target.device, dtype=target.dtype))
