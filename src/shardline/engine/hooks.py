"""The hooks that drive units through a training step.

Note: the life of a unit in one step.

* **pre-forward** (forward pre-hook): gather parameters (all-gather; a no-op when still
  gathered; for SHARD_OPT, only the rows the optimizer changed since the last gather) and
  register them on the modules; cast inputs under mixed precision; hook the
  forward inputs that require grad (*post-backward*, below). The outermost unit whose forward
  starts outside any other unit's forward of its tree is the *forward root*: it first frees
  parameters that an earlier forward left gathered without a backward, so a step never
  computes with parameters gathered before an optimizer step.
* **post-forward** (forward hook): hook every output that requires grad (*pre-backward*); free
  the gathered parameters if the policy says so (FULL_SHARD non-root units; with
  ``reshard_after_forward=N`` keep them split over N ranks instead), or always when no
  backward can come through this call (``no_grad``, or outputs that need no gradient).
* **pre-backward** (a hook on each output's gradient): gather again if freed. It runs before
  any backward node of the module can, because every one of them needs that gradient first.
  The first one of a backward pass queues the tree's *end-of-backward* callback.
* **gradients ready** (a post-accumulate-grad hook on each gathered trainable parameter): once
  every trainable parameter of the unit has its gradient, start the reduction (reduce-scatter,
  then all-reduce across replicas for hybrid sharding; all-reduce for NO_SHARD and SHARD_OPT)
  asynchronously -- or, under ``no_sync``, keep the gradients (``no_sync(reduce_scatter=True)``:
  reduce-scatter and keep the partial sum for the replica all-reduce). At most one reduction is in flight: starting one
  lands the previous, so reductions overlap the next unit's backward without holding every
  unit's buffer at once. The parameters are *not* freed here.
* **post-backward** (a hook on the gradients of the forward inputs, all of them): autograd has
  computed the gradient of the module's inputs, so it is done with the module's parameters
  for this call -- free them. Frozen weights that backward still needs to compute input
  gradients (LoRA's base layer, a frozen norm) are therefore never freed too early, and a unit
  with no trainable parameter at all is gathered for backward and freed the same way.
* **end of backward** (queued on the autograd engine): units that got only some of their
  gradients (parameters unused this step) reduce what they have, in reverse forward order so
  every rank issues the same collectives; every pending reduction lands in ``.grad``; units
  still gathered (their inputs needed no gradient, or backward never reached them) are freed;
  every unit's backward record is reset.

A unit used twice in one forward is freed after the later call's backward and gathered again
by the earlier call's pre-backward hook; its gradients are reduced once, when all uses have
been accumulated. Forward that runs *inside* backward (activation-checkpoint recomputation)
only makes sure parameters are gathered: nothing is freed and no hook is registered, because
the backward that triggered it is about to use them.

Note: torch.compile. A compiled module's ``__call__`` hands every Python frame it runs to
dynamo, the forward hooks' included; traced, the pre-forward hook put the all-gather into the
graph (on gloo, a bitwise-OR all-reduce of the buffer viewed as int32, which inductor cannot
lower). So the forward hooks are marked for dynamo to skip (``_torch_compat.eager_only``, as
torch's FSDP2 marks its own): they run eagerly, and the unit's ``forward`` is one graph whose
inputs are the gathered parameters, registered on the modules before it starts -- the same
tensor objects every step, so nothing recompiles. Compiling a module that *contains* units (the
whole model) breaks the graph at each unit's hooks, and each unit's forward is compiled as its
own frame. The backward hooks need no marking: a compiled forward's backward is one autograd
node, and the hooks on its outputs, inputs and parameters run around it in eager autograd.
Compiled autograd (one graph for the whole backward) cannot trace them and is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook

from shardline import _torch_compat
from shardline._tree import iter_tensors, map_tensors
from shardline.engine.context import RootContext, root_context
from shardline.engine.guards import check_not_inside_ddp
from shardline.engine.quantized import verify_quantized
from shardline.engine.registry import set_unit, subtree_units
from shardline.engine.unit import Residency, ShardUnit
from shardline.errors import ConfigurationError

__all__ = ["install_hooks"]

_COMPILED_AUTOGRAD_UNSUPPORTED = (
    "compiled autograd is capturing a backward pass through unit {name!r} of a model sharded by shardline, which "
    "it does not support: the engine's backward hooks gather and free parameters and start gradient reductions "
    "in the middle of backward and finish them in an end-of-backward callback, and those cannot be traced into one "
    "graph. Run backward outside torch._dynamo.compiled_autograd (compiled blocks keep their compiled backward "
    "without it)."
)

# What dynamo says when a graph breaks at a unit's hook; with fullgraph=True this is the error's text.
_EAGER_HOOK = (
    "shardline's {hook} hook runs eagerly, between compiled graphs: a graph breaks where a sharded unit's "
    "forward begins and ends. With fullgraph=True, compile each sharded unit (torch.compile(block) or "
    "block.compile()) instead of a module that contains units"
)


def install_hooks(unit: ShardUnit) -> None:
    """Attach the forward hooks that drive ``unit`` to its module."""
    module = unit.module
    unit.grad_ready_callback = _on_grad_ready
    # Eager around compiled code (see the note on torch.compile above).
    pre_forward = _torch_compat.eager_only(_PreForward(unit), reason=_EAGER_HOOK.format(hook="pre-forward"))
    post_forward = _torch_compat.eager_only(_PostForward(unit), reason=_EAGER_HOOK.format(hook="post-forward"))
    module.register_forward_pre_hook(pre_forward, prepend=True, with_kwargs=True)
    module.register_forward_hook(post_forward, always_call=True)
    set_unit(module, unit)


class _PreForward:
    __slots__ = ("unit",)

    def __init__(self, unit: ShardUnit) -> None:
        self.unit = unit

    def __call__(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        unit = self.unit
        recomputing = _torch_compat.in_backward()  # activation-checkpoint recomputation
        if recomputing:
            unit.unshard(phase="backward")
        else:
            ctx = root_context(unit)
            if ctx.forward_root is None:
                ctx.forward_root = unit
                _root_pre_forward(ctx, unit)
            ctx.order.setdefault(id(unit), unit)
            ctx.prefetched.pop(id(unit), None)
            unit.unshard(phase="forward")
            if unit.forward_prefetch:
                ctx.prefetch(_neighbor(unit, +1), "forward")
        mp = unit.mixed_precision
        if mp.param_dtype is not None and mp.cast_forward_inputs:
            args, kwargs = map_tensors(_Cast(mp.param_dtype), (args, kwargs))
        if not recomputing and torch.is_grad_enabled():
            args, kwargs = _hook_inputs(unit, args, kwargs)
        return args, kwargs


def _hook_inputs(
    unit: ShardUnit, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Pass the inputs that require grad on as views, and hook the post-backward onto those views.

    Note: why views. The hook must fire when the module's own backward is complete, before
    anything upstream runs. A hook on the caller's tensor ``x`` would share ``x`` with the
    pre-backward hook of the unit that produced ``x`` -- and when that is the same unit, called
    twice (``block(block(x))``), the first call's "gather" would run before the second call's
    "free" and the first call's backward would read freed parameters. The gradient of a view of
    ``x`` is complete strictly before the gradient of ``x`` itself, so the graph orders the two
    hooks. A view also keeps the hook off a caller's leaf tensor, which would carry it forever.
    """
    if not any(t.requires_grad for t in iter_tensors((args, kwargs))):
        return args, kwargs
    args, kwargs = map_tensors(_view_if_grad, (args, kwargs))
    tensors = [t for t in iter_tensors((args, kwargs)) if t.requires_grad]
    register_multi_grad_hook(tensors, _PostBackward(unit), mode="all")
    return args, kwargs


def _view_if_grad(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view_as(tensor) if tensor.requires_grad else tensor


class _PostForward:
    __slots__ = ("unit",)

    def __init__(self, unit: ShardUnit) -> None:
        self.unit = unit

    def __call__(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        unit = self.unit
        if _torch_compat.in_backward():
            return output
        ctx = root_context(unit)
        backward_follows = False
        if torch.is_grad_enabled():
            outputs = [t for t in iter_tensors(output) if t.requires_grad and t.grad_fn is not None]
            if outputs:
                backward_follows = True
                ctx.touch(unit)
                hook = _PreBackward(unit)
                for tensor in outputs:  # one hook per output: any of them may start backward into the module
                    tensor.register_hook(hook)
        if unit.pinned:
            pass
        elif not backward_follows:
            unit.reshard()  # no backward can come through this call
        elif unit.reshard_after_forward and unit.sync_gradients:
            unit.reshard(after_forward=True)
        if ctx.forward_root is unit:
            ctx.forward_root = None
            unit.set_forward_order(list(ctx.order.values()))
            ctx.order = {}
        mp = unit.mixed_precision
        if mp.output_dtype is not None:
            output = map_tensors(_Cast(mp.output_dtype), output)
        return output


class _PreBackward:
    __slots__ = ("unit",)

    def __init__(self, unit: ShardUnit) -> None:
        self.unit = unit

    def __call__(self, _grad: torch.Tensor) -> None:
        unit = self.unit
        if _torch_compat.compiled_autograd_active():
            raise ConfigurationError(_COMPILED_AUTOGRAD_UNSUPPORTED.format(name=unit.display_name))
        ctx = root_context(unit)
        ctx.ensure_final_callback(_finalize_backward)
        ctx.touch(unit)
        ctx.prefetched.pop(id(unit), None)
        unit.unshard(phase="backward")
        if unit.backward_prefetch == "backward_pre":
            ctx.prefetch(_neighbor(unit, -1), "backward")


class _PostBackward:
    __slots__ = ("unit",)

    def __init__(self, unit: ShardUnit) -> None:
        self.unit = unit

    def __call__(self, _grads: Sequence[torch.Tensor | None]) -> None:
        unit = self.unit
        ctx = root_context(unit)
        ctx.ensure_final_callback(_finalize_backward)
        if unit.sync_gradients and unit.policy.reshard_after_backward:
            unit.reshard()
        if unit.backward_prefetch == "backward_post":
            ctx.prefetch(_neighbor(unit, -1), "backward")


class _Cast:
    __slots__ = ("dtype",)

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.dtype) if tensor.is_floating_point() else tensor


def _neighbor(unit: ShardUnit, step: int) -> ShardUnit | None:
    """The unit ``step`` places after ``unit`` in its forward root's order of the previous step."""
    root = unit.forward_root_unit
    if root is None or root.forward_order is None:
        return None
    position = root.forward_position.get(id(unit))
    if position is None:
        return None
    index = position + step
    return root.forward_order[index] if 0 <= index < len(root.forward_order) else None


def _root_pre_forward(ctx: RootContext, root: ShardUnit) -> None:
    check_not_inside_ddp(root)
    ctx.order = {}
    ctx.cancel_prefetches()
    ctx.recover_from_interrupted_backward()
    if root.subtree is None:
        root.subtree = subtree_units(root.module)
    unchecked = [u for u in root.subtree if u.quantized is not None and not u.quantized.verified]
    if unchecked:  # the first forward: every 4-bit weight must still carry its quantization state
        verify_quantized(unchecked, comm=ctx.comm, group=root.mesh.dp_group)
    for unit in root.subtree:
        unit.forward_root_unit = root
        # Left gathered (or partly resharded) by a forward whose backward has not run (touched since the
        # last end of backward); units a no_sync backward keeps gathered on purpose are not touched any more.
        if (
            unit.residency in (Residency.GATHERED, Residency.PARTIAL)
            and unit.sync_gradients
            and id(unit) in ctx.touched
        ):
            unit.reshard()


def _on_grad_ready(unit: ShardUnit, index: int) -> None:
    """Post-accumulate-grad hook of a gathered parameter: reduce once the unit's gradients are complete."""
    ctx = root_context(unit)
    ctx.ensure_final_callback(_finalize_backward)
    ctx.touch(unit)
    if unit.mark_grad_ready(index) and not unit.progress.reduced:
        _reduce(ctx, unit)


def _reduce(ctx: RootContext, unit: ShardUnit) -> None:
    """Reduce (or, under no_sync, set aside) the unit's gradients."""
    if unit.keeps_gradients_local:
        unit.accumulate_unsynced()
    else:
        ctx.advance_pending()  # bound in-flight reductions to one (a hybrid one's all-reduce may stay in flight)
        ctx.pending.extend(unit.reduce_gradients())


def _finalize_backward(ctx: RootContext) -> None:
    """End-of-backward callback: finish partial units, land every reduction, free and reset."""
    ctx.callback_queued = False
    units = list(ctx.touched.values())
    ctx.touched.clear()
    for unit in reversed(units):
        if not unit.progress.reduced and unit.has_unsharded_grads():
            _reduce(ctx, unit)
    ctx.land_pending()
    ctx.cancel_prefetches()
    ctx.memory.drop_spare()
    for unit in units:
        if unit.sync_gradients:
            unit.reshard()
        unit.reset_backward()
