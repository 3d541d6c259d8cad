"""Deferred initialization: build on the meta device, shard, then allocate and initialize shards only.

Note: replaying the CPU initialization bit for bit. A model built on CPU draws its initial
values from the default generator as each module's constructor calls ``reset_parameters()``.
The usual constructor builds its submodules first and then initializes its own parameters
(``nn.MultiheadAttention`` and every torch layer do), so the draws happen children first, in
registration order: a post-order walk. ``materialize`` replays that walk and calls each
module's initializer with *one* parameter backed by a real, full CPU tensor and the module's
other parameters left on the meta device. Random ops on meta
tensors draw nothing from the generator, so the generator advances exactly as it did for the
CPU model, and each real tensor receives the values the CPU model got. Only this rank's rows
are kept; the full tensor is dropped before the next parameter, so no rank ever holds more
than one full parameter.

Tied parameters take the values of their first registration (the name ``named_parameters()``
reports); later registrations still run their initializer on a scratch tensor so the
generator advances as it did on CPU. An initializer that mixes parameters of one module
(e.g. derives a bias from the weight) cannot run with a meta sibling: such a module is
initialized with all its parameters real at once, after rewinding the generator.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from shardline.engine.api import original_class
from shardline.engine.device import default_device_type
from shardline.engine.mesh import require_process_group
from shardline.engine.param import OWNER_ATTR
from shardline.engine.registry import subtree_units
from shardline.engine.traversal import post_order
from shardline.engine.unit import ShardUnit
from shardline.errors import ShardingError

__all__ = ["materialize"]

InitFn = Callable[[nn.Module], None]


def _default_init(module: nn.Module) -> None:
    module.reset_parameters()  # type: ignore[operator]


def _has_own_state(module: nn.Module) -> bool:
    return any(p is not None for p in module._parameters.values()) or any(
        b is not None for b in module._buffers.values()
    )


def materialize(
    model: nn.Module,
    *,
    init_fn: InitFn | None = None,
    device: torch.device | str | None = None,
) -> nn.Module:
    """Allocate and initialize a model that was built on the ``meta`` device and then sharded.

    Each rank allocates only its shards (plus full buffers) and initializes them to exactly
    the values a model built on CPU would have after the same ``torch.manual_seed``: seed the
    default generator identically on every rank before calling, as you would before building
    the model. Modules are initialized children first, each by its ``reset_parameters()``,
    which must initialize the module's own parameters and buffers only (the torch convention);
    buffers computed in a constructor must be recomputed there too. Returns ``model``; the
    parameter objects keep their identity, so an optimizer may be created before or after.

    Args:
        init_fn: Called as ``init_fn(module)`` for every module that owns parameters or
            buffers, instead of ``module.reset_parameters()``. Needed for modules without
            ``reset_parameters`` and for models whose CPU construction initializes differently
            (a custom ``_init_weights`` applied after building, or a constructor that initializes
            its own parameters before building its submodules).
        device: Where shards live; default: a unit's device that is not meta, else the current
            CUDA device when the group communicates CUDA tensors through NCCL, else the CPU.

    Raises:
        ShardingError: A module has meta parameters but no ``reset_parameters`` and no
            ``init_fn`` was given, or a buffer was left uninitialized by its initializer.
    """
    init = init_fn or _default_init
    units = subtree_units(model)
    if units:
        require_process_group("shardline.materialize")
    target = torch.device(device) if device is not None else _default_device(units)

    if init_fn is None:
        lacking = sorted(
            {
                original_class(m).__name__
                for m in model.modules()
                if _has_meta(m)
                and any(p is not None for p in m._parameters.values())
                and not callable(getattr(m, "reset_parameters", None))
            }
        )
        if lacking:
            raise ShardingError(
                f"cannot materialize: module classes {', '.join(lacking)} have meta parameters but no "
                "reset_parameters() method. Pass init_fn=... to shardline.materialize to initialize them."
            )

    # Only shards that were on meta are initialized; real ones keep their values.
    owner: dict[int, tuple[ShardUnit, int]] = {}
    for unit in units:
        if unit.device.type == "meta":
            unit.materialize(target)
            for i, sp in enumerate(unit.params):
                owner[id(sp.sharded)] = (unit, i)

    done: set[int] = set()
    for _, module in post_order(model):
        if _has_meta(module) or any(id(p) in owner for p in module._parameters.values() if p is not None):
            _init_module(module, init if init_fn or hasattr(module, "reset_parameters") else None, owner, done, target)
    return model


def _default_device(units: list[ShardUnit]) -> torch.device:
    for unit in units:
        if unit.device.type != "meta":
            return unit.device
    if units and default_device_type(units[0].mesh.device_map, cuda_available=torch.cuda.is_available()) == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _has_meta(module: nn.Module) -> bool:
    tensors = [*module._parameters.values(), *module._buffers.values()]
    return any(t is not None and t.is_meta for t in tensors)


def _init_module(
    module: nn.Module,
    init: InitFn | None,
    owner: dict[int, tuple[ShardUnit, int]],
    done: set[int],
    device: torch.device,
) -> None:
    """Initialize ``module``'s own parameters one at a time (see the note at the top)."""
    originals = {n: p for n, p in module._parameters.items() if p is not None}
    names = list(originals)
    buffers = _real_buffers(module, device)
    if init is None:  # buffers only and nothing to initialize them with: caught by the NaN check
        names = []
        init = _noop
    state = torch.random.get_rng_state()
    try:
        order: list[str | None] = [*names] if names else [None]
        for name in order:
            scratch = {n: _meta_like(originals[n]) for n in names}
            if name is not None:
                scratch[name] = _full_like(originals[name])
            _set(module, scratch, buffers)
            init(module)
            if name is not None:
                _keep(originals[name], scratch[name], owner, done, device)
    except (RuntimeError, NotImplementedError):
        # The initializer combines parameters (meta and real mixed); rewind and do it at once.
        torch.random.set_rng_state(state)
        buffers = _real_buffers(module, device)
        scratch = {n: _full_like(originals[n]) for n in names}
        _set(module, scratch, buffers)
        init(module)
        for n in names:
            _keep(originals[n], scratch[n], owner, done, device)
    finally:
        for n in names:
            module._parameters[n] = originals[n]
    for bname, value in buffers.items():
        if value.is_floating_point() and torch.isnan(value).any():
            raise ShardingError(
                f"buffer '{bname}' of {original_class(module).__name__} was not initialized by its module's "
                "reset_parameters() (it had no values on the meta device). Compute it in "
                "reset_parameters(), or pass init_fn=... to materialize that fills it."
            )
        module._buffers[bname] = value


def _noop(module: nn.Module) -> None:
    del module


def _real_buffers(module: nn.Module, device: torch.device) -> dict[str, torch.Tensor]:
    """Real storage for the module's meta buffers, NaN-filled so an uninitialized one is caught."""
    out = {}
    for name, b in module._buffers.items():
        if b is None or not b.is_meta:
            continue
        fill = math.nan if b.is_floating_point() else 0
        out[name] = torch.full(b.shape, fill, dtype=b.dtype, device=device)
    return out


def _meta_like(p: nn.Parameter) -> nn.Parameter:
    return nn.Parameter(torch.empty(_full_shape(p), dtype=p.dtype, device="meta"), requires_grad=p.requires_grad)


def _full_like(p: nn.Parameter) -> nn.Parameter:
    return nn.Parameter(torch.empty(_full_shape(p), dtype=p.dtype, device="cpu"), requires_grad=p.requires_grad)


def _full_shape(p: nn.Parameter) -> tuple[int, ...]:
    owned = getattr(p, OWNER_ATTR, None)
    if owned is None:
        return tuple(p.shape)
    unit: ShardUnit
    unit, fqn = owned
    for sp in unit.params:
        if sp.fqn == fqn:
            return sp.layout.shape
    return tuple(p.shape)


def _set(module: nn.Module, params: dict[str, nn.Parameter], buffers: dict[str, torch.Tensor]) -> None:
    for name, value in params.items():
        module._parameters[name] = value
    for name, buffer in buffers.items():
        module._buffers[name] = buffer


@torch.no_grad()
def _keep(
    original: nn.Parameter,
    full: torch.Tensor,
    owner: dict[int, tuple[ShardUnit, int]],
    done: set[int],
    device: torch.device,
) -> None:
    """Store the freshly initialized ``full`` tensor into ``original`` (its shard), first time only."""
    if id(original) in done:
        return  # tied: the first registration's values win; this draw only advanced the generator
    done.add(id(original))
    found = owner.get(id(original))
    if found is not None:
        unit, index = found
        unit.load_full(index, full.to(device))
    elif original.is_meta:
        fresh = nn.Parameter(full.detach().to(device), requires_grad=original.requires_grad)
        torch.utils.swap_tensors(original, fresh)
    else:
        original.copy_(full)
