"""``fully_shard``: turn a module into a unit, and the methods a sharded module gains."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from shardline.engine.context import RootContext, root_context
from shardline.engine.device import resolve_device
from shardline.engine.grad import clip_grad_norm_
from shardline.engine.guards import ddp_ignored_names, install_optimizer_guard
from shardline.engine.hooks import install_hooks
from shardline.engine.mesh import MeshLike, ShardMesh, resolve_mesh
from shardline.engine.mixed_precision import MixedPrecision
from shardline.engine.offload import OffloadPolicy
from shardline.engine.param import OWNER_ATTR, REPLACED_ATTR
from shardline.engine.quantized import is_quantized, split_quantized
from shardline.engine.registry import get_unit, subtree_units
from shardline.engine.state_dict import install_state_dict_hooks
from shardline.engine.strategy import ShardingStrategy
from shardline.engine.unit import ShardUnit
from shardline.errors import ConfigurationError, ShardingError

__all__ = ["ShardedModule", "fully_shard"]

M = TypeVar("M", bound=nn.Module)

_DDP_EXTRA = "_shardline_ddp_extra_ignore"


if TYPE_CHECKING:
    _ModuleBase = nn.Module
else:
    _ModuleBase = object


class ShardedModule(_ModuleBase):
    """Methods every module passed to :func:`fully_shard` gains (its class becomes a subclass).

    ``isinstance(module, shardline.ShardedModule)`` tells whether a module was sharded.

    Note: a mixin, placed before the module's own class (``Sharded<Class>(ShardedModule, Class)``);
    type checkers see it as an ``nn.Module`` subclass, which every instance of it is.
    """

    @property
    def shard_unit(self) -> ShardUnit:
        """The unit that manages this module's own parameters."""
        unit = get_unit(self)
        assert unit is not None  # the class is only swapped by fully_shard, which sets the unit
        return unit

    @contextlib.contextmanager
    def no_sync(self, *, reduce_scatter: bool = False) -> Iterator[None]:
        """Accumulate gradients over micro-batches, communicating less inside the block.

        Default (``reduce_scatter=False``): no gradient collective inside the block. Backward
        passes keep their gradients unreduced (in full, gathered form; in ``reduce_dtype`` when
        that is wider than ``param_dtype``) and keep parameters gathered, so later micro-batches
        need no all-gather either. The first backward after the block reduces the accumulated
        total once. Costs the memory of full gradients and parameters of every unit under this
        module while active.

        ``reduce_scatter=True`` (for hybrid sharding; torch FSDP2 calls it
        ``set_requires_all_reduce(False)``): gradients are still reduce-scattered inside the shard
        group after every micro-batch and parameters are freed as usual, so memory stays sharded;
        only the all-reduce across replicas is deferred, summed into one per unit at the first
        backward after the block. Units with no reduce-scatter to do (NO_SHARD, SHARD_OPT, a shard
        group of one) keep their gradients unreduced as with the default; 1-D sharded units have no
        replicas and reduce as usual.
        """
        units = subtree_units(self)
        attribute = "all_reduce_gradients" if reduce_scatter else "sync_gradients"
        previous = [getattr(unit, attribute) for unit in units]
        for unit in units:
            setattr(unit, attribute, False)
        try:
            yield
        finally:
            for unit, value in zip(units, previous, strict=True):
                setattr(unit, attribute, value)

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, *, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip gradients of all parameters under this module by their true global norm.

        Same semantics as ``torch.nn.utils.clip_grad_norm_`` on the unsharded model: the norm
        covers every parameter once (sharded pieces summed across ranks, replicated ones
        counted once), using one all-reduce. Returns the total norm (before clipping).
        """
        return clip_grad_norm_(self, max_norm, norm_type, error_if_nonfinite=error_if_nonfinite)

    def unshard(self) -> None:
        """Gather this unit's parameters now; they stay gathered until :meth:`reshard`.

        Gathered parameters are copies: changes to them are not written back to the shards.
        """
        self.shard_unit.pin()

    def reshard(self) -> None:
        """Free this unit's gathered parameters and register the shards again."""
        unit = self.shard_unit
        unit.unpin()
        unit.reshard()

    @property
    def _ddp_params_and_buffers_to_ignore(self) -> list[str]:
        """What torch ``DistributedDataParallel`` must leave alone: every parameter shardline manages.

        DDP reads this attribute of the module it wraps. Raises ``ShardingError`` when nothing
        trainable would be left for DDP (see ``shardline.engine.guards``).
        """
        return [*ddp_ignored_names(self), *self.__dict__.get(_DDP_EXTRA, [])]

    @_ddp_params_and_buffers_to_ignore.setter
    def _ddp_params_and_buffers_to_ignore(self, names: list[str]) -> None:
        self.__dict__[_DDP_EXTRA] = list(names)


_CLASS_CACHE: dict[type, type] = {}
_BACKWARD_PREFETCH = ("backward_pre", "backward_post", None)


def _sharded_class(cls: type) -> type:
    new = _CLASS_CACHE.get(cls)
    if new is None:
        namespace: dict[str, Any] = {"__module__": cls.__module__}
        save_pretrained = getattr(cls, "save_pretrained", None)
        if callable(save_pretrained):
            namespace["save_pretrained"] = _save_pretrained_guard(save_pretrained)
        new = type(f"Sharded{cls.__name__}", (ShardedModule, cls), namespace)
        _CLASS_CACHE[cls] = new
    return new


def _save_pretrained_guard(save_pretrained: Callable[..., Any]) -> Callable[..., Any]:
    """``save_pretrained`` of a sharded Hugging Face / PEFT model: only with full weights passed in.

    Without ``state_dict=...`` it would see this rank's DTensor pieces; gathering them inside
    would hang when, as is usual, only rank 0 calls it.
    """

    def guarded(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("state_dict") is None:
            raise ShardingError(
                f"save_pretrained on a {original_class(self).__name__} sharded by shardline needs the full weights, "
                "which are spread over every rank. On every rank run: state_dict = shardline.full_state_dict(model, "
                "rank0_only=True); model.save_pretrained(path, state_dict=state_dict, "
                "is_main_process=torch.distributed.get_rank() == 0). (shardline consolidate writes the same from "
                "a checkpoint, offline.)"
            )
        # What the method records about the model (config.json's "architectures") names the user's
        # class, not the Sharded* subclass: it runs as an instance of the original class.
        sharded = type(self)
        self.__class__ = original_class(self)
        try:
            return save_pretrained(self, *args, **kwargs)
        finally:
            self.__class__ = sharded

    guarded.__doc__ = save_pretrained.__doc__
    guarded.__name__ = "save_pretrained"
    return guarded


def fully_shard(
    module: M,
    *,
    mesh: MeshLike = None,
    strategy: ShardingStrategy | str = ShardingStrategy.FULL_SHARD,
    reshard_after_forward: bool | int | None = None,
    mixed_precision: MixedPrecision | None = None,
    sync_module_states: bool = False,
    forward_prefetch: bool = True,
    backward_prefetch: str | None = "backward_pre",
    device: torch.device | str | None = None,
    offload: OffloadPolicy | None = None,
) -> M:
    """Shard ``module``'s parameters across data-parallel ranks; returns the same module.

    Apply bottom-up: shard the blocks first, then the root. Each call makes one *unit* out of
    the parameters ``module`` owns that no already-sharded descendant owns. A unit gathers its
    parameters with one all-gather before forward (and before backward if it freed them) and
    reduces its gradients with one reduce-scatter (all-reduce for NO_SHARD) as soon as all of
    them are ready, averaging over the data-parallel ranks.

    After the call, ``module.parameters()`` yields this rank's shards (dim-0 ``torch.chunk``
    pieces) as ``nn.Parameter``, so any ``torch.optim`` optimizer works and its state is sharded
    too. The module also gains the methods of :class:`ShardedModule`.

    Args:
        module: The module to shard. Its parameters must share one device; they may mix dtypes
            (e.g. a bf16 frozen base with fp32 adapters): each dtype gets its own flat buffer and
            collectives.
        mesh: A ``ProcessGroup`` or 1-D ``DeviceMesh`` of the data-parallel ranks (default: the
            world); for the hybrid strategies a 2-D ``DeviceMesh`` (replicate, shard), e.g.
            :func:`shardline.hybrid_mesh`.
        strategy: ``"full_shard"`` (ZeRO-3), ``"shard_grad_op"`` (ZeRO-2), ``"shard_opt"`` (ZeRO-1),
            ``"no_shard"`` (ZeRO-0), ``"hybrid_shard"`` or ``"hybrid_shard_zero2"`` (ZeRO-3 / ZeRO-2
            inside each shard group of a 2-D mesh, replicated across groups), or an alias (see
            :class:`ShardingStrategy`). May differ between units.
        reshard_after_forward: Free gathered parameters after forward. ``None``: the strategy's
            default, except for root units (nothing sharded above them), which keep them because
            backward starts with them. An int ``N`` dividing the shard group's size: after forward
            keep the parameters split over groups of ``N`` consecutive ranks of the shard group, so
            backward's all-gather runs inside such a group (e.g. a node); ``N`` equal to the shard
            group's size is ``True``, ``N=1`` is ``False``.
        mixed_precision: Compute / reduce / buffer dtypes; shards stay in the original dtype.
        sync_module_states: Broadcast rank 0's parameters and buffers first, for ranks that
            initialized the model differently.
        forward_prefetch: When this unit's forward starts, start gathering the unit that ran
            after it in the previous step, so that transfer overlaps this unit's compute.
        backward_prefetch: When to start gathering the unit whose backward comes next:
            ``"backward_pre"`` (when this unit's backward starts; most overlap, one more unit
            gathered at a time), ``"backward_post"`` (when this unit's gradients are reduced;
            less memory) or ``None``. Prefetching never changes numerics; at most one gather
            per direction is in flight.
        device: The unit's device. Default: its parameters' device; for a module without
            parameters (a root over sharded blocks) the units' below it, else its buffers'.
            Given, it must agree with the parameters. The process group must communicate it
            (see ``shardline/engine/device.py``).
        offload: :class:`~shardline.CPUOffload` keeps the unit's sharded parameters, their
            gradients and the optimizer state in host memory: the shard is copied to ``device``
            for each all-gather, reduced gradients are copied back, and the optimizer steps on
            the host (see ``shardline/engine/offload.py``). Not with ``shard_opt`` (its
            parameters are whole on every rank). ``None``: no offload.

    Raises:
        DistributedNotInitializedError: No process group is initialized.
        ConfigurationError: Unknown strategy, a mesh of the wrong shape for the strategy or not
            ours, ``reshard_after_forward`` not dividing the shard group, wrong types, ``device=``
            disagreeing with the parameters, a device the process group cannot communicate.
        ShardingError: Sharded twice, applied top-down, a parameter shared with another unit,
            parameters on several devices or of a non-floating-point dtype.
    """
    if not isinstance(module, nn.Module):
        raise ConfigurationError(f"fully_shard expects an nn.Module, got {type(module).__name__}")
    if get_unit(module) is not None:
        raise ShardingError(
            f"this {original_class(module).__name__} is already sharded: fully_shard was called on it before. "
            "Call fully_shard once per module."
        )
    strategy = ShardingStrategy.parse(strategy)
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, (bool, int)):
        raise ConfigurationError(
            f"reshard_after_forward must be True, False, None or a positive int dividing the shard group's size, "
            f"got {reshard_after_forward!r}"
        )
    if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
        raise ConfigurationError(
            f"mixed_precision must be a shardline.MixedPrecision or None, got {type(mixed_precision).__name__}"
        )
    _check_offload(offload, strategy)
    if backward_prefetch not in _BACKWARD_PREFETCH:
        raise ConfigurationError(
            f"backward_prefetch must be one of 'backward_pre', 'backward_post' or None, got {backward_prefetch!r}"
        )
    shard_mesh = resolve_mesh(mesh, strategy.policy, strategy.value)
    _check_reshard_after_forward(reshard_after_forward, strategy, shard_mesh)

    owned, buffers, sub_units = _collect(module, original_class(module).__name__)
    device = _unit_device(owned, buffers, sub_units, shard_mesh, device)
    owned, quantized = split_quantized(owned)  # 4-bit frozen weights: kept apart (engine/quantized.py)
    ctx = RootContext()
    if sync_module_states:
        _broadcast_from_rank0(module, [p for _, p, _ in owned], [b for _, _, b in buffers], shard_mesh, ctx)

    unit = ShardUnit(
        module,
        params=owned,
        mesh=shard_mesh,
        strategy=strategy,
        reshard_after_forward=reshard_after_forward,
        mixed_precision=mixed_precision,
        device=device,
        offload=offload,
        quantized=quantized,
    )
    ctx.adopt(unit)
    for (fqn, original, _), sp in zip(owned, unit.params, strict=True):
        setattr(original, OWNER_ATTR, (unit, fqn))
        setattr(original, REPLACED_ATTR, fqn)
        setattr(sp.sharded, OWNER_ATTR, (unit, fqn))
    for (fqn, original, _), qp in zip(quantized, unit.quantized.params if unit.quantized else [], strict=True):
        setattr(original, OWNER_ATTR, (unit, fqn))
        setattr(original, REPLACED_ATTR, fqn)
        setattr(qp.sharded, OWNER_ATTR, (unit, fqn))
    unit.forward_prefetch = bool(forward_prefetch)
    unit.backward_prefetch = backward_prefetch
    _cast_buffers(unit, buffers)
    for _, sub in sub_units:
        sub.is_root = False
        ctx.absorb(root_context(sub))
    for fqn, m in module.named_modules():
        below = get_unit(m)
        if below is not None and m is not module:
            below.name = fqn
    install_hooks(unit)
    install_state_dict_hooks(unit)
    install_optimizer_guard()
    module.__class__ = _sharded_class(type(module))
    return module


def _check_offload(offload: object, strategy: ShardingStrategy) -> None:
    """``offload`` must be an :class:`OffloadPolicy`; CPU offload needs a strategy that keeps flat shards."""
    if offload is None:
        return
    if not isinstance(offload, OffloadPolicy):
        raise ConfigurationError(
            f"offload must be a shardline.CPUOffload (or None), got {type(offload).__name__}: {offload!r}"
        )
    if strategy.policy.shard_optimizer and not strategy.policy.shard_params:
        raise ConfigurationError(
            f"offload={offload!r} is not supported with strategy {strategy.value}: ZeRO-1 keeps the whole "
            "parameters on every rank and updates them in place on the device, so there is no shard to keep on the "
            "host. Use shard_grad_op (ZeRO-2) or full_shard (ZeRO-3) with offload, or leave offload out."
        )


def _check_reshard_after_forward(value: bool | int | None, strategy: ShardingStrategy, mesh: ShardMesh) -> None:
    """An int ``reshard_after_forward`` must divide the shard group of a strategy that shards parameters."""
    if value is None or isinstance(value, bool):
        return
    size = mesh.shard_size
    divisors = [d for d in range(1, size + 1) if size % d == 0]
    if not strategy.policy.shard_params:
        raise ConfigurationError(
            f"reshard_after_forward={value} keeps parameters split over {value} ranks after forward, but strategy "
            f"{strategy.value} does not shard parameters (every rank keeps them whole). Use it with full_shard or "
            "hybrid_shard, or pass None."
        )
    if value < 1 or size % value:
        raise ConfigurationError(
            f"reshard_after_forward={value} must divide the shard group's size {size} (parameters stay split over "
            f"groups of that many consecutive ranks after forward). Valid values: {divisors} (or True/False/None)."
        )


def original_class(module: nn.Module) -> type:
    """The class a module had before ``fully_shard`` swapped in its ``Sharded*`` subclass."""
    cls = type(module)
    return cls.__bases__[1] if issubclass(cls, ShardedModule) and len(cls.__bases__) == 2 else cls


def _owner(param: nn.Parameter) -> tuple[ShardUnit, str] | None:
    return getattr(param, OWNER_ATTR, None)


def _collect(
    module: nn.Module, module_name: str
) -> tuple[
    list[tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]],
    list[tuple[nn.Module, str, torch.Tensor]],
    list[tuple[str, ShardUnit]],
]:
    """Parameters and buffers ``module`` owns (stopping at sharded descendants), and those descendants."""
    params: dict[int, tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]] = {}
    buffers: list[tuple[nn.Module, str, torch.Tensor]] = []
    sub_units: list[tuple[str, ShardUnit]] = []
    seen_modules: set[int] = set()

    def visit(m: nn.Module, prefix: str) -> None:
        if id(m) in seen_modules:
            return
        seen_modules.add(id(m))
        for name, p in m._parameters.items():
            if p is None:
                continue
            fqn = prefix + name
            owner = _owner(p)
            if owner is not None:
                other, other_fqn = owner
                where = other.name or original_class(other.module).__name__
                if p is not _sharded_of(other, other_fqn):
                    raise ShardingError(
                        f"parameter '{fqn}' of the {module_name} being sharded is shared with parameter "
                        f"'{other_fqn}' of '{where}', which is already sharded as its own unit. Tied or "
                        f"shared parameters must live in one unit: do not shard '{where}' separately "
                        "(shard a common ancestor of both modules instead), or untie the parameters."
                    )
                raise ShardingError(
                    f"parameter '{fqn}' of the {module_name} being sharded is already managed by the unit at "
                    f"'{where}' (as '{other_fqn}'): fully_shard must be applied bottom-up -- shard inner "
                    "blocks first, then their parents, then the root."
                )
            entry = params.get(id(p))
            if entry is None:
                params[id(p)] = (fqn, p, [(m, name)])
            else:
                entry[2].append((m, name))
        for name, b in m._buffers.items():
            if b is not None:
                buffers.append((m, name, b))
        for name, child in m._modules.items():
            if child is None:
                continue
            sub = get_unit(child)
            if sub is not None:
                sub_units.append((prefix + name, sub))
                continue
            visit(child, prefix + name + ".")

    visit(module, "")
    return list(params.values()), buffers, sub_units


def _sharded_of(unit: ShardUnit, fqn: str) -> nn.Parameter | None:
    for sp in unit.params:
        if sp.fqn == fqn:
            return sp.sharded
    for qp in unit.quantized.params if unit.quantized is not None else []:
        if qp.fqn == fqn:
            return qp.sharded
    return None


def _unit_device(
    owned: list[tuple[str, nn.Parameter, Any]],
    buffers: list[tuple[nn.Module, str, torch.Tensor]],
    sub_units: list[tuple[str, ShardUnit]],
    mesh: ShardMesh,
    explicit: torch.device | str | None,
) -> torch.device:
    """The unit's device: its parameters', else ``device=``, its sub-units', its buffers' (see ``engine/device.py``)."""
    for fqn, p, _ in owned:
        if not p.dtype.is_floating_point and not is_quantized(p):  # a Params4bit holds packed uint8 codes
            raise ShardingError(
                f"parameter '{fqn}' has dtype {p.dtype}; only floating-point parameters can be sharded. Register "
                "integer state as a buffer (module.register_buffer) instead."
            )
    cuda = torch.cuda.is_available()
    return resolve_device(
        params=[(fqn, p.device) for fqn, p, _ in owned],
        device_map=mesh.device_map,
        backend=str(dist.get_backend(mesh.dp_group)),
        explicit=torch.device(explicit) if explicit is not None else None,
        sub_units=[(name, sub.device) for name, sub in sub_units],
        buffers=[(f"{type(m).__name__}.{name}", b.device) for m, name, b in buffers],
        cuda_available=cuda,
        current_cuda=torch.cuda.current_device() if cuda else 0,
    )


@torch.no_grad()
def _broadcast_from_rank0(
    module: nn.Module, params: list[nn.Parameter], buffers: list[torch.Tensor], mesh: ShardMesh, ctx: RootContext
) -> None:
    tensors = [t for t in [*params, *buffers] if t.numel()]
    if any(t.is_meta for t in tensors):
        raise ShardingError(
            "sync_module_states=True needs materialized parameters, but some are on the meta device. "
            "Shard the meta model without it and call shardline.materialize(model), which initializes "
            "every rank identically."
        )
    if mesh.dp_size == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for group in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in group])
        ctx.comm.broadcast(flat, mesh.dp_group, unit=type(module).__name__, phase="init")
        offset = 0
        for t in group:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


def _cast_buffers(unit: ShardUnit, buffers: list[tuple[nn.Module, str, torch.Tensor]]) -> None:
    dtype = unit.mixed_precision.buffer_dtype
    if dtype is None:
        return
    for m, name, b in buffers:
        if b.is_floating_point() and b.dtype != dtype:
            unit.buffer_dtypes[(m, name)] = b.dtype
            m._buffers[name] = b.to(dtype)
