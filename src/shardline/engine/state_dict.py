"""Full (unsharded) state dicts of a sharded model: gather to save, scatter to load."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from shardline.engine import comm
from shardline.engine.state import subtree_units
from shardline.engine.unit import ShardUnit, pack_rows
from shardline.errors import StateDictError

__all__ = ["full_state_dict", "key_problems", "load_full_state_dict"]

_SHOW = 10  # entries listed per category in error messages


def key_problems(
    expected: Iterable[str], given: Iterable[str], *, missing: str = "missing", unexpected: str = "unexpected"
) -> list[str]:
    """``["missing N key(s): a, b", "unexpected M key(s): c"]`` for the keys one side lacks (empty if none).

    ``missing`` and ``unexpected`` word the two kinds in the messages.
    """
    expected, given = list(expected), list(given)
    given_set, expected_set = set(given), set(expected)
    absent = [k for k in expected if k not in given_set]
    extra = [k for k in given if k not in expected_set]
    problems = []
    if absent:
        problems.append(f"{missing} {len(absent)} key(s): {', '.join(absent[:_SHOW])}")
    if extra:
        problems.append(f"{unexpected} {len(extra)} key(s): {', '.join(extra[:_SHOW])}")
    return problems


def _param_index(units: list[ShardUnit]) -> dict[int, tuple[ShardUnit, int]]:
    """``id(tensor) -> (unit, param index)`` for both the shard and the gathered parameter."""
    index: dict[int, tuple[ShardUnit, int]] = {}
    for unit in units:
        for i, sp in enumerate(unit.params):
            index[id(sp.sharded)] = (unit, i)
            if sp.unsharded is not None:
                index[id(sp.unsharded)] = (unit, i)
    return index


def _buffer_dtypes(units: list[ShardUnit]) -> dict[int, torch.dtype]:
    return {id(m._buffers[name]): dtype for unit in units for (m, name), dtype in unit.buffer_dtypes.items()}


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def full_state_dict(model: nn.Module, *, rank0_only: bool = False, cpu_offload: bool = True) -> dict[str, torch.Tensor]:
    """The model's state dict with every parameter gathered to its full, original shape.

    A collective: every rank must call it. Units are gathered one at a time (peak memory: the
    largest unit, not the model), in the master dtype. Keys and order equal the unsharded
    module's ``state_dict()``; tied parameters map to one tensor under each of their keys.
    Buffers come back in their original dtype even if ``MixedPrecision.buffer_dtype`` cast them.

    Args:
        rank0_only: Only rank 0 keeps the tensors; other ranks return an empty dict.
        cpu_offload: Move every tensor to CPU (each unit right after it is gathered).
    """
    units = subtree_units(model)
    index = _param_index(units)
    buffer_dtypes = _buffer_dtypes(units)
    keep = _is_rank0() or not rank0_only
    local = model.state_dict(keep_vars=True)

    keys_of: dict[int, list[str]] = {}
    for key, value in local.items():
        keys_of.setdefault(id(value), []).append(key)

    out: dict[str, torch.Tensor] = {}
    gathered: set[int] = set()
    for key, value in local.items():
        found = index.get(id(value))
        if found is None:  # a buffer, or a parameter no unit manages
            if keep:
                tensor = value.detach().to(buffer_dtypes.get(id(value), value.dtype), copy=True)
                out[key] = tensor.cpu() if cpu_offload else tensor
            continue
        unit, _ = found
        if id(unit) in gathered:
            continue
        gathered.add(id(unit))
        fulls = unit.gather_full()
        if not keep:
            continue
        for sp, full in zip(unit.params, fulls, strict=True):
            full = full.cpu() if cpu_offload else full
            for tensor in (sp.sharded, sp.unsharded):
                for k in keys_of.get(id(tensor), []) if tensor is not None else []:
                    out[k] = full
    return {key: out[key] for key in local if key in out}


def load_full_state_dict(
    model: nn.Module,
    state_dict: Mapping[str, torch.Tensor] | None,
    *,
    strict: bool = True,
    broadcast_from_rank0: bool = False,
) -> None:
    """Load a full (unsharded) state dict into a sharded model; each rank keeps its rows.

    With ``broadcast_from_rank0=False`` (default) every rank passes the full state dict and no
    communication happens. With ``True`` only rank 0 needs it (others may pass ``None``): rank 0
    validates it and scatters each unit's shards (one scatter per unit; a broadcast for
    NO_SHARD units) and broadcasts buffers. In that mode every parameter must be present even
    with ``strict=False``, because rank 0 cannot know the current value of other ranks' shards.

    Raises:
        StateDictError: With ``strict``, missing or unexpected keys; always, mismatched shapes.
            Raised on every rank (also with ``broadcast_from_rank0``), before any value is written.
    """
    units = subtree_units(model)
    index = _param_index(units)
    local = model.state_dict(keep_vars=True)

    problem = None
    if not broadcast_from_rank0 or _is_rank0():
        if state_dict is None:
            raise StateDictError("load_full_state_dict got None; pass the full state dict")
        problem = _validate(local, state_dict, index, strict, require_params=broadcast_from_rank0)
    if broadcast_from_rank0 and dist.is_initialized() and dist.get_world_size() > 1:
        box = [problem]
        dist.broadcast_object_list(box, src=0)
        problem = box[0]
    if problem:
        raise StateDictError(problem)

    for unit in units:
        unit.pinned = False
        unit.reshard()  # gathered copies would be stale

    done: set[int] = set()
    with torch.no_grad():
        for key, value in local.items():
            found = index.get(id(value))
            if broadcast_from_rank0:
                if found is not None:
                    unit = found[0]
                    if id(unit) not in done:
                        done.add(id(unit))
                        _scatter_unit(unit, local, state_dict)
                else:
                    _broadcast_into(value, state_dict.get(key) if _is_rank0() and state_dict else None, units)
                continue
            if key not in state_dict:
                continue
            source = state_dict[key]
            if found is not None:
                unit, i = found
                unit.load_full(i, source.to(device=unit.device, dtype=unit.master_dtype))
            else:
                value.copy_(source.to(device=value.device, dtype=value.dtype))


def _validate(
    local: Mapping[str, torch.Tensor],
    given: Mapping[str, torch.Tensor],
    index: dict[int, tuple[ShardUnit, int]],
    strict: bool,
    *,
    require_params: bool,
) -> str | None:
    if strict:
        parts = key_problems(local, given)
    elif require_params:  # sharded parameters cannot keep their values without a gather on rank 0
        parts = key_problems([k for k in local if id(local[k]) in index], [k for k in given if k in local])
    else:
        parts = []
    mismatched = []
    for key, value in local.items():
        if key not in given:
            continue
        found = index.get(id(value))
        shape = found[0].params[found[1]].layout.shape if found else tuple(value.shape)
        got = tuple(given[key].shape)
        if got != tuple(shape):
            mismatched.append(f"{key}: checkpoint {got} vs model {tuple(shape)}")
    if mismatched:
        parts.append(f"{len(mismatched)} shape mismatch(es): {'; '.join(mismatched[:_SHOW])}")
    if not parts:
        return None
    return (
        "the state dict does not fit the model -- "
        + " | ".join(parts)
        + ". Check that it comes from the same model configuration (pass strict=False to ignore missing "
        "and unexpected keys; shapes must always match)."
    )


def _scatter_unit(
    unit: ShardUnit, local: Mapping[str, torch.Tensor], state_dict: Mapping[str, torch.Tensor] | None
) -> None:
    """Rank 0 packs the unit's full tensors rank-major; every rank receives its flat shard."""
    source = None
    if _is_rank0():
        keys = {id(v): k for k, v in local.items()}
        fulls = []
        for sp in unit.params:
            key = keys.get(id(sp.sharded)) or keys.get(id(sp.unsharded))
            fulls.append(state_dict[key].to(device=unit.device, dtype=unit.master_dtype))
        world = unit.mesh.shard_size
        source = torch.cat(
            [
                pack_rows(t, sp.layout, world, unit.master_dtype, unit.device)
                for t, sp in zip(fulls, unit.params, strict=True)
            ],
            dim=1,
        )
    if unit.mesh.shard_size > 1:
        chunks = list(source.unbind(0)) if source is not None else None
        comm.scatter(unit.flat_shard, chunks, unit.mesh.shard_group, unit=unit.display_name, phase="load")
    else:
        if source is not None:
            unit.flat_shard.copy_(source.view(-1))
        if unit.mesh.replicate_size > 1:
            comm.broadcast(unit.flat_shard, unit.mesh.replicate_group, unit=unit.display_name, phase="load")


def _broadcast_into(target: torch.Tensor, source: torch.Tensor | None, units: list[ShardUnit]) -> None:
    if source is not None:
        target.copy_(source.to(device=target.device, dtype=target.dtype))
    if dist.is_initialized() and dist.get_world_size() > 1:
        group = units[0].mesh.dp_group if units else dist.group.WORLD
        comm.broadcast(target.data, group, phase="load")
