"""Optimizer state dicts keyed by parameter FQN, in the same three kinds as model state dicts.

Layout (the one ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` uses)::

    {"state": {fqn: {name: value, ...}, ...},
     "param_groups": [{"params": [fqn, ...], "lr": ..., ...}, ...]}

A state tensor shaped like its parameter's shard is **elementwise** (Adam's ``exp_avg``, SGD's
momentum): sharded kind gives it as a DTensor piece placed like the parameter, full kind as
the gathered tensor, local kind as is. A 0-d tensor is **scalar** state (Adam's ``step``) and
is the same on every rank. Any other shape is rejected: shardline shards optimizers
elementwise. Elementwise state of a 0-d parameter has shape ``(1,)`` in every kind, so it is
never confused with scalar state. Non-tensor values are kept as they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from shardline.checkpoint.coordination import coord
from shardline.checkpoint.state.model_state import StateDictKind, check_kind, param_index
from shardline.engine._checkpoint_support import (
    HOST_OOM,
    ManagedParam,
    gather_full_tensors,
    host_copy,
    registered_state_dict,
)
from shardline.errors import CheckpointMismatchError, ConfigurationError, StateDictError

__all__ = ["load_optimizer_state_dict", "optimizer_params", "optimizer_state_dict"]

_SHOW = 10
Managed = ManagedParam | None


def optimizer_params(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[tuple[torch.Tensor, str, Managed]]:
    """``(param, fqn, ManagedParam or None)`` for each parameter the optimizer holds, in group order.

    The FQN is the parameter's first name in ``model.state_dict()`` (tied parameters have one).
    """
    index = param_index(model)
    names: dict[int, str] = {}
    for key, value in registered_state_dict(model).items():
        found = index.get(id(value))
        target = id(found.shard) if found else id(value)
        names.setdefault(target, key)
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            fqn = names.get(id(p))
            if fqn is None:
                raise ConfigurationError(
                    f"the optimizer holds a parameter of shape {tuple(p.shape)} that is not a parameter of the model "
                    "(or the model was sharded after the optimizer was built: build the optimizer from "
                    "model.parameters() after fully_shard/wrap)"
                )
            found = index.get(id(p))
            out.append((p, fqn, found))
    return out


def _kind_of(value: Any, managed: Managed, fqn: str, name: str) -> str:
    if not isinstance(value, torch.Tensor):
        return "value"
    if value.dim() == 0:
        return "scalar"
    if managed is None or tuple(value.shape) == managed.local_shape:
        return "elementwise"
    raise CheckpointMismatchError(
        f"optimizer state '{name}' of parameter '{fqn}' has shape {tuple(value.shape)}, neither the parameter "
        f"shard's shape {managed.local_shape} nor a scalar; shardline checkpoints support optimizers "
        "whose state is elementwise (SGD, Adam, AdamW, RMSprop, ...)"
    )


def _groups(optimizer: torch.optim.Optimizer, fqn_of: dict[int, str]) -> list[dict[str, Any]]:
    out = []
    for group in optimizer.param_groups:
        saved = {k: v for k, v in group.items() if k != "params"}
        saved["params"] = [fqn_of[id(p)] for p in group["params"]]
        out.append(saved)
    return out


def optimizer_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, *, kind: StateDictKind = "sharded"
) -> dict[str, Any]:
    """The optimizer's state keyed by parameter FQN (see the module docstring for the layout).

    ``full`` is a collective that gathers elementwise state unit by unit (one all-gather per
    unit and state name) and returns it on rank 0 only (CPU); other ranks get an empty dict.
    ``sharded`` and ``local`` share memory with the optimizer and need no communication.
    """
    check_kind(kind)
    params = optimizer_params(model, optimizer)
    fqn_of = {id(p): fqn for p, fqn, _ in params}
    state: dict[str, dict[str, Any]] = {}
    for p, fqn, managed in params:
        entry = optimizer.state.get(p)
        if not entry:
            continue
        out: dict[str, Any] = {}
        for name, value in entry.items():
            form = _kind_of(value, managed, fqn, name)
            if form == "elementwise" and managed is not None and kind == "sharded":
                out[name] = managed.to_dtensor(value.detach())
            elif isinstance(value, torch.Tensor):
                out[name] = value.detach()
            else:
                out[name] = value
        state[fqn] = out
    result = {"state": state, "param_groups": _groups(optimizer, fqn_of)}
    if kind != "full":
        return result
    held: dict[str, dict[str, Any]] = {}

    def gather() -> None:
        held["full"] = _gather_full(params, result)

    # A failure on one rank (host memory on rank 0) is raised there after the last gather; agree on it.
    coord.all_succeed(gather, None, what="gather the full optimizer state")
    return held["full"]


def _signature(
    params: list[tuple[torch.Tensor, str, Managed]], state: Mapping[str, Mapping[str, Any]]
) -> list[tuple[str, str, str]]:
    sig = []
    for _, fqn, managed in params:
        for name, value in sorted(state.get(fqn, {}).items()):
            if isinstance(value, torch.Tensor) and value.dim() > 0 and managed is not None:
                sig.append((fqn, name, str(value.dtype)))
    return sig


def _gather_full(params: list[tuple[torch.Tensor, str, Managed]], result: dict[str, Any]) -> dict[str, Any]:
    state = result["state"]
    # Note: every rank must issue the same all-gathers; check the structure first (one small
    # collective) so that ranks whose optimizers differ fail with a message instead of hanging.
    signatures = coord.all_gather_object(_signature(params, state), None)
    if any(s != signatures[0] for s in signatures):
        raise CheckpointMismatchError(
            "ranks hold different optimizer state structures (parameters or state names differ), so the full "
            "optimizer state dict cannot be gathered; run the same optimizer steps on every rank"
        )
    rank0 = coord.group_rank(None) == 0
    full_state: dict[str, dict[str, Any]] = {
        fqn: {n: (v.cpu().clone() if isinstance(v, torch.Tensor) else v) for n, v in entry.items()}
        for fqn, entry in state.items()
    }
    managed = [(fqn, handle) for _, fqn, handle in params if handle is not None]
    oom: tuple[str, BaseException] | None = None
    keys = sorted(
        {
            (name, value.dtype)
            for fqn, _ in managed
            for name, value in state.get(fqn, {}).items()
            if isinstance(value, torch.Tensor) and value.dim() > 0
        },
        key=lambda item: (item[0], str(item[1])),
    )
    for name, dtype in keys:
        # Only parameters that hold this state (identical on every rank: the signatures agree).
        members = [
            (fqn, handle, state[fqn][name])
            for fqn, handle in managed
            if isinstance(state.get(fqn, {}).get(name), torch.Tensor) and state[fqn][name].dtype == dtype
        ]
        fulls = gather_full_tensors([(handle, tensor) for _, handle, tensor in members], dtype=dtype)
        if oom is not None:
            continue  # keep joining the gathers (see full_state_dict's note), keep nothing
        try:
            for (fqn, _, _), full in zip(members, fulls, strict=True):
                if full is not None:
                    full_state[fqn][name] = host_copy(full)
        except HOST_OOM as e:
            oom = (name, e)
            full_state.clear()
    if oom is not None:
        raise StateDictError(
            f"gathering the full optimizer state ran out of host memory on this rank at state {oom[0]!r} "
            f"({type(oom[1]).__name__}: {oom[1]}); the gathers were completed without keeping anything. Save with "
            "kind='sharded' (no gather), or give this rank more host memory."
        ) from oom[1]
    return {"state": full_state, "param_groups": result["param_groups"]} if rank0 else {}


def _broadcast_full(state_dict: Mapping[str, Any] | None) -> dict[str, Any]:
    """Rank 0's full optimizer state dict on every rank (structure first, then one broadcast per tensor)."""
    rank0 = coord.group_rank(None) == 0
    skeleton = None
    if rank0:
        if state_dict is None:
            raise ConfigurationError("load_optimizer_state_dict(kind='full'): rank 0 passed None")
        skeleton = {
            "param_groups": state_dict["param_groups"],
            "state": {
                fqn: {
                    n: ("tensor", list(v.shape), str(v.dtype).removeprefix("torch."))
                    if isinstance(v, torch.Tensor)
                    else ("value", v)
                    for n, v in entry.items()
                }
                for fqn, entry in state_dict["state"].items()
            },
        }
    skeleton = coord.broadcast_object(skeleton, None)
    if coord.group_size(None) == 1:
        return dict(state_dict)  # type: ignore[arg-type]
    device = coord.control_device(dist.group.WORLD)
    state: dict[str, dict[str, Any]] = {}
    for fqn, entry in skeleton["state"].items():
        state[fqn] = {}
        for name, spec in entry.items():
            if spec[0] == "value":
                state[fqn][name] = spec[1]
                continue
            if rank0:
                tensor = state_dict["state"][fqn][name].to(device).contiguous()  # type: ignore[index]
            else:
                tensor = torch.empty(spec[1], dtype=getattr(torch, spec[2]), device=device)
            dist.broadcast(tensor, src=0, group=dist.group.WORLD)
            state[fqn][name] = tensor
    return {"state": state, "param_groups": skeleton["param_groups"]}


def load_optimizer_state_dict(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    state_dict: Mapping[str, Any] | None,
    *,
    kind: StateDictKind = "sharded",
) -> None:
    """Load an FQN-keyed optimizer state dict of the given kind into ``optimizer``.

    Hyperparameters of each param group are restored as saved (as ``Optimizer.load_state_dict``
    does); groups are matched by position and must hold the same parameters. ``full`` is a
    collective: rank 0 passes the dict, other ranks may pass ``None``, and each rank keeps its
    rows. ``sharded`` and ``local`` need the layout the dict was taken with.

    Raises:
        CheckpointMismatchError: groups, parameters or state shapes that do not fit; raised
            before the optimizer is touched.
    """
    check_kind(kind)
    if kind == "full":
        state_dict = _broadcast_full(state_dict)
    if state_dict is None or "state" not in state_dict or "param_groups" not in state_dict:
        raise ConfigurationError(
            "an optimizer state dict must be a mapping with 'state' and 'param_groups' "
            "(as optimizer_state_dict returns)"
        )
    params = optimizer_params(model, optimizer)
    by_fqn = {fqn: (p, managed) for p, fqn, managed in params}
    problems: list[str] = []
    unknown = [fqn for fqn in state_dict["state"] if fqn not in by_fqn]
    if unknown:
        problems.append(
            f"state for {len(unknown)} parameter(s) the optimizer does not hold: {', '.join(unknown[:_SHOW])}"
        )
    saved_groups = list(state_dict["param_groups"])
    if len(saved_groups) != len(optimizer.param_groups):
        problems.append(f"{len(saved_groups)} param group(s) saved vs {len(optimizer.param_groups)} in the optimizer")
    else:
        for i, (saved, group) in enumerate(zip(saved_groups, optimizer.param_groups, strict=True)):
            current = {fqn for p, fqn, _ in params if any(p is q for q in group["params"])}
            given = set(saved.get("params", []))
            if current != given:
                only_saved, only_here = sorted(given - current), sorted(current - given)
                problems.append(
                    f"param group {i} differs: only in the checkpoint {only_saved[:_SHOW]}, only in the optimizer "
                    f"{only_here[:_SHOW]}"
                )
    local_state: dict[int, dict[str, Any]] = {}
    position = {id(p): i for i, (p, _, _) in enumerate(params)}
    for fqn, entry in state_dict["state"].items():
        if fqn not in by_fqn:
            continue
        p, managed = by_fqn[fqn]
        converted: dict[str, Any] = {}
        for name, value in entry.items():
            try:
                converted[name] = _local_value(value, managed, fqn, name, kind)
            except CheckpointMismatchError as e:
                problems.append(str(e))
        local_state[position[id(p)]] = converted
    if problems:
        shown = "; ".join(problems[:_SHOW])
        raise CheckpointMismatchError(
            f"the optimizer state does not fit this optimizer -- {shown}. Build the optimizer with the same "
            "parameter groups as when it was saved."
        )
    groups = []
    for saved, group in zip(saved_groups, optimizer.param_groups, strict=True):
        restored = {k: v for k, v in saved.items() if k != "params"}
        restored["params"] = [position[id(p)] for p in group["params"]]
        groups.append(restored)
    optimizer.load_state_dict({"state": local_state, "param_groups": groups})


def _local_value(value: Any, managed: Managed, fqn: str, name: str, kind: str) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    if isinstance(value, DTensor):
        value = value.to_local()
        kind = "local"
    if value.dim() == 0 or managed is None:
        return value
    if kind == "full":
        if tuple(value.shape) != managed.global_shape:
            raise CheckpointMismatchError(f"'{fqn}'.{name}: full shape {tuple(value.shape)} vs {managed.global_shape}")
        return managed.local_rows(value).clone()
    if tuple(value.shape) != managed.local_shape:
        raise CheckpointMismatchError(
            f"'{fqn}'.{name}: local piece {tuple(value.shape)} vs this rank's shard {managed.local_shape} "
            "(taken at another world size or strategy)"
        )
    return value
