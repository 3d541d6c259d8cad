"""State dicts of a sharded model: DTensor pieces from ``state_dict()``, full tensors on request.

Note: what ``module.state_dict()`` returns. A sharded module keeps plain local tensors as its
parameters (the optimizer step pays no DTensor dispatch), but its ``state_dict()`` gives each
managed parameter as a ``DTensor`` -- ``Shard(0)`` over the shard group, ``[Replicate(),
Shard(0)]`` over a hybrid 2-D mesh, ``Replicate()`` for NO_SHARD -- built over the live shard
without a copy, the way torch's FSDP2 presents its parameters. torch DCP,
``torch.distributed.checkpoint.state_dict`` and any DTensor-aware saver therefore see whole
tensors of the right global shape. ``load_state_dict`` takes those DTensors back, or full
tensors (each rank keeps its rows). Both are hooks on each unit's module, so they also work
when the sharded module is a submodule of something else. A 0-d parameter appears with shape
``(1,)`` (``Shard(0)`` needs a dimension).

Engine code that needs the registered tensors themselves uses :func:`plain_state_dict`.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from shardline.engine.flat import FlatGroup, flat_group
from shardline.engine.param import ShardedParam
from shardline.engine.registry import subtree_units
from shardline.engine.unit import ShardUnit
from shardline.errors import ShardingError, StateDictError

__all__ = [
    "HOST_OOM",
    "ManagedParam",
    "buffer_original_dtypes",
    "full_state_dict",
    "gather_full_tensors",
    "host_copy",
    "install_state_dict_hooks",
    "key_problems",
    "load_full_state_dict",
    "managed_parameters",
    "plain_state_dict",
    "registered_state_dict",
    "release_all",
]

_SHOW = 10  # entries listed per category in error messages
_PLAIN: contextvars.ContextVar[bool] = contextvars.ContextVar("shardline_plain_state_dict", default=False)


# ---------------------------------------------------------------------- the public handle
class ManagedParam:
    """A parameter shardline manages, as code outside the engine may see it.

    Attributes:
        fqn: Its name relative to the module of the unit that manages it.
        unit: The display name of that unit.
        shard: The ``nn.Parameter`` registered between steps (this rank's rows, master dtype).
        shape: The parameter's own shape (``()`` for a 0-d parameter).
        global_shape: Its shape as DTensors and optimizer state show it (``(1,)`` for a 0-d parameter).
        local_shape: The shape of this rank's shard.
        dtype: The master dtype.
    """

    __slots__ = ("_sp", "_unit")

    def __init__(self, unit: ShardUnit, sp: ShardedParam) -> None:
        self._unit, self._sp = unit, sp

    fqn = property(lambda self: self._sp.fqn)
    unit = property(lambda self: self._unit.display_name)
    shard = property(lambda self: self._sp.sharded)
    shape = property(lambda self: self._sp.layout.shape)
    global_shape = property(lambda self: self._sp.global_shape)
    local_shape = property(lambda self: self._sp.layout.local_shape)
    dtype = property(lambda self: flat_group(self._sp).dtype)

    def to_dtensor(self, local: torch.Tensor | None = None) -> DTensor:
        """``local`` (default: the shard), shaped like the shard, as a DTensor piece placed like it (no copy)."""
        return flat_group(self._sp).to_dtensor(self._sp, local)

    def local_rows(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of ``full`` (the parameter's full shape), shaped like the shard."""
        pl = self._sp.layout
        if tuple(full.shape) not in (pl.shape, self._sp.global_shape):
            raise StateDictError(
                f"'{self.fqn}': a full tensor of shape {tuple(full.shape)} does not fit the parameter's shape "
                f"{pl.shape}"
            )
        return flat_group(self._sp).local_rows(pl, full)

    @torch.no_grad()
    def load_full(self, full: torch.Tensor) -> None:
        """Copy this rank's rows of the full tensor ``full`` into the shard (any dtype/device; cast on copy)."""
        self.local_rows(full)  # checks the shape
        group = flat_group(self._sp)
        group.load_full(self._sp, full.to(device=group.master.device, dtype=group.dtype))

    def __repr__(self) -> str:
        return f"ManagedParam({self.fqn!r} of {self.unit!r}, global {self.global_shape}, local {self.local_shape})"


def managed_parameters(model: nn.Module) -> dict[int, ManagedParam]:
    """``id(tensor) -> ManagedParam`` for the shard and the gathered tensor of every parameter under ``model``."""
    index: dict[int, ManagedParam] = {}
    for unit in subtree_units(model):
        for sp in unit.params:
            handle = ManagedParam(unit, sp)
            index[id(sp.sharded)] = handle
            if sp.unsharded is not None:
                index[id(sp.unsharded)] = handle
    return index


def gather_full_tensors(
    items: Sequence[tuple[ManagedParam, torch.Tensor | None]], *, dtype: torch.dtype
) -> list[torch.Tensor | None]:
    """All-gather shard-shaped tensors (e.g. optimizer state) of managed parameters to full ones.

    A collective: every rank must pass the same parameters in the same order. One all-gather
    per parameter group involved; entries whose tensor is ``None`` or of another dtype come back
    ``None``. Full tensors have the parameter's ``global_shape``.
    """
    by_group: dict[int, tuple[FlatGroup, ShardUnit, dict[int, torch.Tensor]]] = {}
    for handle, tensor in items:
        sp = handle._sp
        group = flat_group(sp)
        entry = by_group.setdefault(id(group), (group, handle._unit, {}))
        if tensor is not None and tensor.dtype == dtype:
            entry[2][id(sp)] = tensor
    out: dict[int, torch.Tensor | None] = {}
    for group, unit, tensors in by_group.values():
        fulls = group.gather_full(
            [tensors.get(id(sp)) for sp in group.params],
            dtype=dtype,
            comm=unit.ctx.comm,
            name=unit.display_name,
            phase="checkpoint",
        )
        for sp, full in zip(group.params, fulls, strict=True):
            out[id(sp)] = None if full is None else full.reshape(sp.global_shape)
    return [out.get(id(handle._sp)) for handle, _ in items]


def buffer_original_dtypes(model: nn.Module) -> dict[int, torch.dtype]:
    """``id(buffer) -> original dtype`` for buffers that ``MixedPrecision.buffer_dtype`` cast."""
    return {
        id(m._buffers[name]): dtype
        for unit in subtree_units(model)
        for (m, name), dtype in unit.buffer_dtypes.items()
        if m._buffers.get(name) is not None
    }


def release_all(model: nn.Module) -> None:
    """Free gathered parameters of every unit (pinned ones too), so loads write shards nothing stale shadows."""
    for unit in subtree_units(model):
        unit.release()


@contextlib.contextmanager
def plain_state_dict() -> Iterator[None]:
    """Inside the block, ``state_dict()``/``load_state_dict()`` of sharded modules skip the DTensor hooks."""
    token = _PLAIN.set(True)
    try:
        yield
    finally:
        _PLAIN.reset(token)


def registered_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict(keep_vars=True)`` as registered: shards (or gathered tensors), not DTensors."""
    with plain_state_dict():
        return model.state_dict(keep_vars=True)


# ---------------------------------------------------------------------- module hooks
def install_state_dict_hooks(unit: ShardUnit) -> None:
    """Make ``unit.module``'s ``state_dict()`` give DTensors and its ``load_state_dict()`` take them."""
    unit.module.register_state_dict_post_hook(_SaveHook(unit))
    unit.module.register_load_state_dict_pre_hook(_LoadHook(unit))
    if unit.quantized is not None:
        # Frozen 4-bit weights are not part of any state dict (engine/quantized.py): they come from the base model.
        keys = _quantized_keys(unit)
        unit.module.register_state_dict_post_hook(_DropQuantized(keys))
        on_load = _DropQuantized(keys)
        unit.module.register_load_state_dict_pre_hook(on_load)
        unit.module.register_load_state_dict_post_hook(_ForgiveQuantized(on_load))


def _quantized_keys(unit: ShardUnit) -> list[str]:
    """State-dict keys (relative to the unit's module) of the unit's NF4 weights."""
    assert unit.quantized is not None
    owners: dict[int, list[str]] = {}
    for qp in unit.quantized.params:
        for owner, attr in qp.locations:
            owners.setdefault(id(owner), []).append(attr)
    return [
        f"{name}.{attr}" if name else attr
        for name, m in unit.module.named_modules(remove_duplicate=False)
        for attr in owners.get(id(m), [])
    ]


class _DropQuantized:  # no __slots__: torch tags public state-dict hooks with an attribute
    """Takes the unit's NF4 weights out of a state dict being saved, or loaded (remembering where)."""

    def __init__(self, keys: list[str]) -> None:
        self.keys = keys
        self.prefixes: set[str] = set()

    def __call__(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *_rest: Any) -> None:
        self.prefixes.add(prefix)
        for key in self.keys:
            state_dict.pop(prefix + key, None)
            # bitsandbytes' Linear4bit also saves its weight's quantization state as "<weight>.<stat>" entries
            for stat in [k for k in state_dict if k.startswith(f"{prefix}{key}.")]:
                del state_dict[stat]


class _ForgiveQuantized:
    """After a load: the unit's NF4 weights are not missing (no state dict holds them)."""

    def __init__(self, on_load: _DropQuantized) -> None:
        self.on_load = on_load

    def __call__(self, module: nn.Module, incompatible: Any) -> None:
        expected = {prefix + key for prefix in self.on_load.prefixes for key in self.on_load.keys}
        incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if k not in expected]


def _relative_keys(unit: ShardUnit) -> list[tuple[str, ShardedParam]]:
    """Every state-dict key (relative to the unit's module) under which one of its parameters appears."""
    owners: dict[int, list[tuple[str, ShardedParam]]] = {}
    for sp in unit.params:
        for owner, attr in sp.locations:
            owners.setdefault(id(owner), []).append((attr, sp))
    keys = []
    for name, m in unit.module.named_modules(remove_duplicate=False):
        for attr, sp in owners.get(id(m), []):
            keys.append((f"{name}.{attr}" if name else attr, sp))
    return keys


class _SaveHook:  # no __slots__: torch tags public state-dict hooks with an attribute
    def __init__(self, unit: ShardUnit) -> None:
        self.unit = unit
        self.keys: list[tuple[str, ShardedParam]] | None = None

    def __call__(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, _meta: Any) -> None:
        if _PLAIN.get():
            return
        if self.keys is None:
            self.keys = _relative_keys(self.unit)
        for key, sp in self.keys:
            if prefix + key in state_dict:
                state_dict[prefix + key] = flat_group(sp).to_dtensor(sp)


class _LoadHook:
    def __init__(self, unit: ShardUnit) -> None:
        self.unit = unit
        self.keys: list[tuple[str, ShardedParam]] | None = None

    def __call__(
        self,
        module: nn.Module,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        if _PLAIN.get():
            return
        if local_metadata.get("assign_to_params_buffers"):
            raise ShardingError(
                "load_state_dict(assign=True) would replace the shards of a sharded module with new tensors "
                "outside its flat buffers; load without assign=True (values are copied into the shards)."
            )
        self.unit.release()  # gathered copies would be stale; the registered shards receive the values
        if self.keys is None:
            self.keys = _relative_keys(self.unit)
        for key, sp in self.keys:
            full_key = prefix + key
            if full_key in state_dict:
                piece = _local_piece(sp, state_dict[full_key], full_key, error_msgs)
                state_dict[full_key] = piece if piece is not None else sp.sharded.detach()


def _local_piece(sp: ShardedParam, value: object, key: str, error_msgs: list[str]) -> torch.Tensor | None:
    """This rank's shard of ``value`` (a DTensor or a full tensor), or None after recording an error."""
    pl, group = sp.layout, flat_group(sp)
    if not isinstance(value, torch.Tensor):
        error_msgs.append(f"'{key}': expected a tensor, got {type(value).__name__}")
        return None
    shape = tuple(value.shape)
    if shape not in (pl.shape, sp.global_shape):
        error_msgs.append(
            f"size mismatch for {key}: the state dict has shape {shape}, the model's parameter {pl.shape} "
            f"(this rank holds {pl.local_shape} of it)"
        )
        return None
    if isinstance(value, DTensor):
        if all(isinstance(p, Replicate) for p in value.placements):
            value = value.to_local()  # the full tensor itself
        elif tuple(value.to_local().shape) == pl.local_shape and group.mesh.places_like(
            value.device_mesh, tuple(value.placements), value.device.type
        ):
            return value.to_local()  # placed exactly like the shard
        else:
            value = value.full_tensor()  # another layout: every rank loads, so every rank gathers
    return group.local_rows(pl, value)


# ---------------------------------------------------------------------- full state dicts
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


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def full_state_dict(model: nn.Module, *, rank0_only: bool = False, cpu_offload: bool = True) -> dict[str, torch.Tensor]:
    """The model's state dict with every parameter gathered to its full, original shape.

    A collective: every rank must call it. Units are gathered one at a time (peak memory: the
    largest unit, not the model), each parameter in its master dtype. Keys and order equal the
    unsharded module's ``state_dict()``; tied parameters map to one tensor under each of their
    keys. Buffers come back in their original dtype even if ``MixedPrecision.buffer_dtype`` cast
    them.

    Args:
        rank0_only: Only rank 0 keeps the tensors; other ranks return an empty dict.
        cpu_offload: Move every tensor to CPU (each unit right after it is gathered).

    Raises:
        StateDictError: host memory ran out on this rank; raised after every gather was joined,
            so the peers are not left waiting in one.
    """
    index = managed_parameters(model)
    original = buffer_original_dtypes(model)
    keep = _is_rank0() or not rank0_only
    local = registered_state_dict(model)

    keys_of: dict[int, list[str]] = {}
    for key, value in local.items():
        keys_of.setdefault(id(value), []).append(key)

    out: dict[str, torch.Tensor] = {}
    gathered: set[int] = set()
    # Note: host memory can run out on the rank that keeps the tensors (rank 0 alone, with
    # rank0_only). Raising there at once would leave its peers waiting in the next unit's
    # all-gather until the timeout, so that rank drops what it holds, keeps joining the gathers,
    # and raises after the last one; callers that need every rank to learn of it agree on the
    # outcome (the checkpoint save does).
    oom: tuple[str, BaseException] | None = None
    for key, value in local.items():
        found = index.get(id(value))
        if found is None:  # a buffer, or a parameter no unit manages
            if keep and oom is None:
                try:
                    tensor = value.detach().to(original.get(id(value), value.dtype), copy=True)
                    out[key] = host_copy(tensor) if cpu_offload else tensor
                except HOST_OOM as e:
                    oom, keep = (key, e), False
                    out.clear()
            continue
        unit = found._unit
        if id(unit) in gathered:
            continue
        gathered.add(id(unit))
        fulls = unit.gather_full()
        if not keep:
            continue
        try:
            for sp, full in zip(unit.params, fulls, strict=True):
                full = host_copy(full) if cpu_offload else full
                for registered in (sp.sharded, sp.unsharded):
                    for k in keys_of.get(id(registered), []) if registered is not None else []:
                        out[k] = full
        except HOST_OOM as e:
            oom, keep = (unit.name or "<root>", e), False
            out.clear()
    if oom is not None:
        where, error = oom
        raise StateDictError(
            f"gathering the full state dict ran out of host memory on this rank at {where!r} ({type(error).__name__}: "
            f"{error}); the gathers were completed without keeping anything. Save with kind='sharded' (no gather), "
            "or give this rank more host memory."
        ) from error
    return {key: out[key] for key in local if key in out}


HOST_OOM: tuple[type[BaseException], ...] = (MemoryError,) + (
    (torch.OutOfMemoryError,) if hasattr(torch, "OutOfMemoryError") else ()
)
"""What running out of host memory raises: ``MemoryError``, or torch's allocator error."""


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in host memory (the copy a full state dict keeps; may raise one of :data:`HOST_OOM`)."""
    return tensor.cpu()


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
    validates it and scatters each parameter group's shards (one scatter per group; a broadcast
    for NO_SHARD units) and broadcasts buffers. In that mode every parameter must be present even
    with ``strict=False``, because rank 0 cannot know the current value of other ranks' shards.

    Raises:
        StateDictError: With ``strict``, missing or unexpected keys; always, mismatched shapes.
            Raised on every rank (also with ``broadcast_from_rank0``), before any value is written.
    """
    units = subtree_units(model)
    index = managed_parameters(model)
    local = registered_state_dict(model)

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

    release_all(model)  # gathered copies would be stale
    done: set[int] = set()
    with torch.no_grad():
        for key, value in local.items():
            found = index.get(id(value))
            if broadcast_from_rank0:
                if found is not None:
                    unit = found._unit
                    if id(unit) not in done:
                        done.add(id(unit))
                        _scatter_unit(unit, local, state_dict)
                else:
                    _broadcast_into(value, state_dict.get(key) if _is_rank0() and state_dict else None, units)
                continue
            assert state_dict is not None  # every rank passed one (checked above)
            if key not in state_dict:
                continue
            source = state_dict[key]
            if found is not None:
                found.load_full(source)
            else:
                value.copy_(source.to(device=value.device, dtype=value.dtype))


def _validate(
    local: Mapping[str, torch.Tensor],
    given: Mapping[str, torch.Tensor],
    index: dict[int, ManagedParam],
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
        shape = found.shape if found else tuple(value.shape)
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
    """Rank 0 packs each group's full tensors rank-major; every rank receives its flat shards."""
    keys = {id(v): k for k, v in local.items()}
    rank0 = _is_rank0()
    for group in unit.groups:
        fulls = None
        if rank0 and state_dict is not None:
            fulls = []
            for sp in group.params:
                key = keys.get(id(sp.sharded)) or keys.get(id(sp.unsharded))
                assert key is not None  # _validate required every parameter
                fulls.append(state_dict[key].to(device=group.device, dtype=group.dtype))
        group.scatter_from_rank0(fulls, is_source=rank0, comm=unit.ctx.comm, name=unit.display_name, phase="load")


def _broadcast_into(target: torch.Tensor, source: torch.Tensor | None, units: list[ShardUnit]) -> None:
    if source is not None:
        target.copy_(source.to(device=target.device, dtype=target.dtype))
    if dist.is_initialized() and dist.get_world_size() > 1:
        if units:
            units[0].ctx.comm.broadcast(target.data, units[0].mesh.dp_group, phase="load")
        else:
            dist.broadcast(target.data, src=0)
