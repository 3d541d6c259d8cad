"""Predict per-rank memory before running: ZeRO formulas on the real unit layout, activations by dry run.

Nothing is allocated: the model is built on fake tensors, the wrap policy is applied to
find the units (the same bottom-up ownership ``fully_shard`` uses), and each unit's sizes come
from the same layout arithmetic the engine uses (``torch.chunk`` rows padded to a flat
buffer). With ``Ψ`` parameters, ``W`` ranks (``S`` per shard group for the hybrid strategies),
fp32 master weights and AdamW:

=====================  ===========================  ===================  ==================
component              FULL_SHARD / SHARD_GRAD_OP   SHARD_OPT (ZeRO-1)   NO_SHARD (ZeRO-0)
                       (hybrid: S instead of W)
=====================  ===========================  ===================  ==================
parameters (master)    4Ψ/W                         4Ψ                   4Ψ
gradients (reduced)    4Ψ/W                         4Ψ                   4Ψ
optimizer state        8Ψ/W (+4 B step per tensor)  8Ψ/W (+4 B ...)      8Ψ
gathered parameters    root + largest unit          0, or every unit's   0, or every unit's
                       (ZeRO-3; with                cast copy            cast copy
                       ``reshard_after_forward=N``
                       plus the 1/N pieces kept
                       by the units not yet
                       backwarded), every unit
                       (ZeRO-2); in param dtype
communication          max(one all-gather, one      one all-reduce       one all-reduce
                       all-gather (ZeRO-3 only) +   output (gathers      output
                       one reduction; hybrid: +     land in place)
                       the previous unit's reduced
                       shard, its all-reduce in
                       flight)
activations            what autograd saves for one micro-batch, measured by running forward and
                       the loss on fake tensors -- except the model's own parameters and
                       buffers, which backward reads where the engine keeps them (counted
                       above, or freed after forward and gathered again)
=====================  ===========================  ===================  ==================

Padding makes the real numbers slightly above ``Ψ/W``; the estimate includes it exactly.

Note: why parameters are not activations. A linear layer saves its weight (as a transposed
view) for backward, so counting every saved storage counts every weight once more. For a
wide model at micro-batch 1 that dominates: a 7.45B-parameter GPT at W=64 came out at 29.6 GB
of "activations", all of it weights that FULL_SHARD frees after forward and gathers again
for backward (their memory is the gathered-parameter component, one unit at a time).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardline import _torch_compat
from shardline.engine import (
    FlatLayout,
    MixedPrecision,
    ParamLayout,
    ShardingStrategy,
    apply_activation_checkpointing,
    hybrid_degrees,
    post_order,
)
from shardline.errors import ConfigurationError

__all__ = ["MemoryEstimate", "UnitSizes", "estimate_memory", "measure_activations", "plan_units"]

_MASTER_BYTES = 4  # fp32 master shards and their gradients


@dataclass(frozen=True)
class UnitSizes:
    """One unit's sizes on rank 0 (the rank with the most rows), in elements.

    Attributes:
        numel: The unit's parameters, whole.
        trainable_numel: Its trainable parameters, whole.
        shard_numel: One rank's padded flat shard (what an all-gather sends).
        grad_shard_numel: The same over trainable parameters only (a reduce-scatter's output).
        local_trainable_numel: The trainable rows this rank's optimizer steps.
        trainable_tensors: Trainable parameters (one optimizer ``step`` each).
        unsharded_numel: The gathered, parameter-major buffer.
        post_numel: One rank's piece after ``reshard_after_forward=N`` (0 without it).
    """

    name: str
    is_root: bool
    numel: int
    trainable_numel: int
    shard_numel: int
    grad_shard_numel: int
    local_trainable_numel: int
    trainable_tensors: int
    unsharded_numel: int
    post_numel: int = 0


@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted bytes per rank, by component. ``peak`` is the steady state plus transients."""

    strategy: str
    world_size: int
    parameters: int
    sharded_params: int
    sharded_grads: int
    optimizer_state: int
    unsharded_params: int
    unsharded_grads: int
    comm_buffers: int
    activations: int
    units: list[UnitSizes] = field(default_factory=list)
    shard_size: int = 0
    replicate_size: int = 0

    @property
    def steady(self) -> int:
        """Held between steps: master parameters, their gradients, optimizer state."""
        return self.sharded_params + self.sharded_grads + self.optimizer_state

    @property
    def peak(self) -> int:
        """Steady state plus the transients of a step (gathered parameters and gradients, buffers, activations)."""
        return self.steady + self.unsharded_params + self.unsharded_grads + self.comm_buffers + self.activations

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(steady=self.steady, peak=self.peak)
        return out


def plan_units(model: nn.Module, policy: Callable[[nn.Module], bool] | None) -> list[tuple[str, list[nn.Parameter]]]:
    """``(unit name, parameters)`` as ``wrap(model, policy)`` would group them; the root last."""
    owner: dict[int, str] = {}
    params: dict[int, nn.Parameter] = {}
    names = [name for name, m in post_order(model) if m is not model and policy is not None and policy(m)]
    modules = dict(model.named_modules())
    for name in [*names, ""]:
        module = modules[name]
        for p in module.parameters():
            if id(p) not in owner:
                owner[id(p)] = name
                params[id(p)] = p
    units: dict[str, list[nn.Parameter]] = {name: [] for name in [*names, ""]}
    for key, name in owner.items():
        units[name].append(params[key])
    return [(name, units[name]) for name in [*names, ""] if units[name] or name == ""]


def _unit_sizes(name: str, params: list[nn.Parameter], world: int, post: int | None) -> UnitSizes:
    layouts = [ParamLayout.build(p.shape, world, 0) for p in params]
    trainable = [pl for p, pl in zip(params, layouts, strict=True) if p.requires_grad]
    flat = FlatLayout.build(layouts, world)
    post_numel = (
        FlatLayout.build([ParamLayout.build(p.shape, post, 0) for p in params], post).shard_numel if post else 0
    )
    return UnitSizes(
        name=name or "<root>",
        is_root=name == "",
        numel=sum(pl.numel for pl in layouts),
        trainable_numel=sum(pl.numel for pl in trainable),
        shard_numel=flat.shard_numel,
        grad_shard_numel=FlatLayout.build(trainable, world).shard_numel,
        local_trainable_numel=sum(pl.local_numel for pl in trainable),
        trainable_tensors=len(trainable),
        unsharded_numel=flat.unsharded_numel,
        post_numel=post_numel,
    )


def measure_activations(
    model: nn.Module,
    tokens: torch.Tensor,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    *,
    attribute: Callable[[int, int], None] | None = None,
) -> int:
    """Bytes autograd saves for backward in one forward (and loss) of ``model`` on ``tokens``.

    Counted per storage (a tensor saved twice, or several views of one buffer, count once).
    The model's parameters and buffers are not activations, nor are views of them (a linear
    layer saves its weight transposed): backward reads them where they live. Works on real
    and on fake tensors. ``attribute(key, nbytes)`` is also called for every counted storage.
    """
    state = {_torch_compat.storage_key(t) for t in (*model.parameters(), *model.buffers())}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _torch_compat.storage_key(t)
        if key not in state:
            size = t.untyped_storage().nbytes()
            seen[key] = size
            if attribute is not None:
                attribute(key, size)
        return t

    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        out = model(tokens)
        logits = out.logits if hasattr(out, "logits") else out
        loss = (loss_fn or _lm_loss)(logits, tokens)
    del loss
    return sum(seen.values())


def _lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())


def estimate_memory(
    model_fn: Callable[[], nn.Module],
    *,
    policy: Callable[[nn.Module], bool] | None,
    strategy: ShardingStrategy | str,
    world_size: int,
    micro_batch_size: int,
    seq_len: int,
    mixed_precision: MixedPrecision | None = None,
    checkpointing_policy: Callable[[nn.Module], bool] | None = None,
    shard_size: int | None = None,
    reshard_after_forward: bool | int | None = None,
    in_place_gathers: bool = True,
) -> MemoryEstimate:
    """Predict one rank's memory for training the model ``model_fn()`` builds, with AdamW.

    The model is built under torch's fake-tensor mode: shapes and dtypes, no memory, so this
    works for models that do not fit anywhere.

    Args:
        model_fn: Builds the model (e.g. ``lambda: GPT(cfg)``); called once, in fake mode.
        policy: The wrap policy (``None``: the whole model is one unit).
        strategy: Any :class:`~shardline.ShardingStrategy` (or an alias).
        world_size: Data-parallel ranks.
        micro_batch_size, seq_len: One rank's micro-batch (token ids).
        mixed_precision: The strategy's mixed precision (parameter / reduction dtypes).
        checkpointing_policy: Modules whose activations are recomputed in backward. Activations
            are then what the checkpointed forward keeps plus one checkpointed module's
            activations, re-created during its backward.
        shard_size: Hybrid strategies: ranks per shard group (``-1``/``None``: all of them, one replica).
        reshard_after_forward: As passed to ``wrap`` (an int ``N``: units keep a 1/N piece after forward).
        in_place_gathers: All-gathers land in the gathered buffer itself (gloo on CPU, the default
            backend there); False for NCCL, where a rank-major buffer (and a cast copy under mixed
            precision) is gathered and copied out.
    """
    strategy = ShardingStrategy.parse(strategy)
    if world_size < 1:
        raise ConfigurationError(f"world_size must be >= 1, got {world_size}")
    shard = world_size
    if strategy.policy.hybrid and shard_size not in (None, -1):
        shard = hybrid_degrees(world_size=world_size, shard_size=int(shard_size))[1]
    post = None
    frees = strategy.policy.shard_params and strategy.policy.reshard_after_forward
    if isinstance(reshard_after_forward, bool):
        frees = strategy.policy.shard_params and reshard_after_forward
    elif isinstance(reshard_after_forward, int):
        if not strategy.policy.shard_params or reshard_after_forward < 1 or shard % reshard_after_forward:
            raise ConfigurationError(
                f"reshard_after_forward={reshard_after_forward} must divide the shard group's size {shard} of a "
                "strategy that shards parameters"
            )
        post = reshard_after_forward if 1 < reshard_after_forward < shard else None
        frees = reshard_after_forward > 1
    with _torch_compat.fake_tensor_mode():
        model = model_fn()
        estimate = _estimate(
            model,
            policy,
            strategy,
            world_size,
            shard,
            (frees, post),
            micro_batch_size,
            seq_len,
            mixed_precision,
            in_place_gathers,
        )
        if checkpointing_policy is None:
            return estimate
        tokens = torch.zeros(micro_batch_size, seq_len, dtype=torch.long)
        recompute = max(_per_module_activations(model, tokens, checkpointing_policy, mixed_precision), default=0)
        checkpointed = model_fn()
        apply_activation_checkpointing(checkpointed, checkpointing_policy)
        kept = _dry_activations(checkpointed, tokens, mixed_precision or MixedPrecision())
        return dataclasses.replace(estimate, activations=kept + recompute)


def _estimate(
    model: nn.Module,
    policy: Callable[[nn.Module], bool] | None,
    strategy: ShardingStrategy,
    world_size: int,
    shard: int,
    after_forward: tuple[bool, int | None],
    micro_batch_size: int,
    seq_len: int,
    mixed_precision: MixedPrecision | None,
    in_place_gathers: bool,
) -> MemoryEstimate:
    knobs = strategy.policy
    frees, post = after_forward  # gathered parameters freed after forward; kept split over `post` ranks
    replicated = knobs.replicated_params  # NO_SHARD and SHARD_OPT keep full parameters
    # The layout ranks: the shard group (SHARD_OPT: the optimizer's split; NO_SHARD: one rank).
    shard_world = shard if knobs.shard_optimizer else 1
    mp = mixed_precision or MixedPrecision()
    units = [_unit_sizes(name, params, shard_world, post) for name, params in plan_units(model, policy)]
    if not units:
        raise ConfigurationError("the model has no parameters to estimate")
    master = next(iter(model.parameters())).dtype
    param_bytes = torch.empty((), dtype=mp.compute_dtype(master)).element_size()
    reduce_bytes = torch.empty((), dtype=mp.gradient_reduce_dtype(master)).element_size()
    cast = param_bytes != _MASTER_BYTES
    aliased = (replicated or shard_world == 1) and not cast
    zero1 = knobs.shard_optimizer and not knobs.shard_params

    if zero1:  # full parameters (param-major, rows padded to the optimizer's split) and all-reduced gradients
        sharded_params = sum(u.unsharded_numel for u in units) * _MASTER_BYTES
        sharded_grads = sum(u.trainable_numel for u in units) * _MASTER_BYTES
    else:
        sharded_params = sum(u.shard_numel for u in units) * _MASTER_BYTES
        sharded_grads = sum(u.grad_shard_numel for u in units) * _MASTER_BYTES
    optimizer_state = sum(2 * u.local_trainable_numel + u.trainable_tensors for u in units) * _MASTER_BYTES

    gathered = [0 if aliased else u.unsharded_numel * param_bytes for u in units]
    root_gathered = sum(g for u, g in zip(units, gathered, strict=True) if u.is_root)
    blocks = [(g, u.post_numel * param_bytes) for u, g in zip(units, gathered, strict=True) if not u.is_root]
    if aliased:
        unsharded = 0
    elif frees:
        # Backward gathers blocks in reverse; while block k is gathered, the blocks before it still
        # hold their post-forward pieces (none without reshard_after_forward=N), and so does block k
        # until its gather -- which sends that piece -- has landed.
        unsharded = root_gathered + max(
            (g + sum(p for _, p in blocks[: k + 1]) for k, (g, _) in enumerate(blocks)), default=0
        )
    else:  # kept from forward through backward: every unit at once
        unsharded = sum(gathered)

    # Full-size gradients exist between autograd computing them and the reduction packing them:
    # at most the root (whose backward ends last) and one block at a time.
    full_grad = [u.numel * param_bytes for u in units]
    unsharded_grads = sum(g for u, g in zip(units, full_grad, strict=True) if u.is_root) + max(
        (g for u, g in zip(units, full_grad, strict=True) if not u.is_root), default=0
    )

    def all_gather(u: UnitSizes) -> int:
        if shard_world == 1:
            return 0
        if zero1:  # in place in the full parameters, or this rank's rows packed (fp32) and the gathered rows
            return 0 if in_place_gathers else (shard_world + 1) * u.shard_numel * _MASTER_BYTES
        if in_place_gathers and (u.unsharded_numel * param_bytes) % 4 == 0:  # straight into the gathered buffer
            return u.unsharded_numel * param_bytes
        return shard_world * u.shard_numel * param_bytes + (u.shard_numel * param_bytes if cast else 0)

    def reduction(u: UnitSizes) -> int:
        if replicated:  # an all-reduce of the unit's packed gradients, in place
            return u.trainable_numel * reduce_bytes
        packed = shard_world * u.grad_shard_numel * reduce_bytes if shard_world > 1 else 0
        return packed + u.grad_shard_numel * reduce_bytes

    # Forward: a unit's gather is copied out and freed before the next one is prefetched, so one
    # all-gather buffer at a time. Backward: the prefetched gather of the next unit can be in flight
    # while this unit's gradients are packed and reduced (one reduction in flight at a time).
    largest_gather = max(all_gather(u) for u in units)
    largest_reduction = max(reduction(u) for u in units)
    regather = frees and any(not u.is_root for u in units)
    # Hybrid sharding chains each reduce-scatter's all-reduce across replicas behind it: the previous
    # unit's reduced shard stays in flight while the next unit packs and reduce-scatters (engine/pending.py).
    chained = knobs.hybrid and shard_world > 1 and world_size // shard > 1
    in_flight = max(u.grad_shard_numel * reduce_bytes for u in units) if chained else 0
    comm_buffers = max(largest_gather, (largest_gather if regather else 0) + largest_reduction + in_flight)

    device = next(iter(model.parameters())).device
    tokens = torch.zeros(micro_batch_size, seq_len, dtype=torch.long, device=device)
    activations = _dry_activations(model, tokens, mp)
    return MemoryEstimate(
        strategy=strategy.value,
        world_size=world_size,
        parameters=sum(u.numel for u in units),
        sharded_params=sharded_params,
        sharded_grads=sharded_grads,
        optimizer_state=optimizer_state,
        unsharded_params=unsharded,
        unsharded_grads=unsharded_grads,
        comm_buffers=comm_buffers,
        activations=activations,
        units=units,
        shard_size=shard if knobs.shard_optimizer else 1,
        replicate_size=world_size // shard if knobs.hybrid else (1 if knobs.shard_optimizer else world_size),
    )


def _per_module_activations(
    model: nn.Module, tokens: torch.Tensor, policy: Callable[[nn.Module], bool], mp: MixedPrecision | None
) -> list[int]:
    """Activations saved inside each module matching ``policy`` (forward without checkpointing)."""
    sizes: dict[int, dict[int, int]] = {}
    stack: list[int] = []
    handles = []

    def enter(module: nn.Module, _args: tuple[object, ...]) -> None:
        stack.append(id(module))

    def leave(module: nn.Module, _args: tuple[object, ...], _out: object) -> None:
        stack.pop()

    for module in model.modules():
        if module is not model and policy(module):
            sizes[id(module)] = {}
            handles.append(module.register_forward_pre_hook(enter))
            handles.append(module.register_forward_hook(leave))

    def attribute(key: int, size: int) -> None:
        if stack:
            sizes[stack[-1]][key] = size

    try:
        _dry_activations(model, tokens, mp or MixedPrecision(), attribute=attribute)
    finally:
        for handle in handles:
            handle.remove()
    return [sum(per.values()) for per in sizes.values()]


def _dry_activations(
    model: nn.Module, tokens: torch.Tensor, mp: MixedPrecision, attribute: Callable[[int, int], None] | None = None
) -> int:
    """Activations of one micro-batch, with parameters temporarily in the compute dtype."""
    if mp.param_dtype is None:
        return measure_activations(model, tokens, attribute=attribute)
    originals = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and p.is_floating_point():
                originals[(module, name)] = p
                module._parameters[name] = nn.Parameter(p.detach().to(mp.param_dtype), requires_grad=p.requires_grad)
    try:
        return measure_activations(model, tokens, attribute=attribute)
    finally:
        for (module, name), p in originals.items():
            module._parameters[name] = p
