"""The hooks that drive units through a training step, and the little global state they share.

Note: the life of a unit in one step.

* **pre-forward** (forward pre-hook): gather parameters (all-gather; a no-op when still
  gathered) and register them on the modules; cast inputs under mixed precision. The
  outermost unit whose forward starts outside any other unit's forward is the *forward root*:
  it first frees parameters that an earlier forward left gathered without a backward, so a
  step never computes with parameters gathered before an optimizer step.
* **post-forward** (forward hook): if autograd will come back, register a hook on the
  outputs that fires when their first gradient is computed (*pre-backward*), and free the
  gathered parameters if the policy says so (FULL_SHARD non-root units).
* **pre-backward**: gather again if freed. The first one of a backward pass queues the
  *final callback* on the autograd engine.
* **post-backward**: every gathered parameter has a post-accumulate-grad hook; when all of a
  unit's trainable parameters have their gradient, the unit packs them and starts its
  reduce-scatter (or all-reduce) asynchronously, then frees its gathered parameters. At most
  one reduction is in flight: starting one first lands the previous one, so reductions
  overlap the next unit's backward compute without holding every unit's buffer at once.
* **final callback** (end of backward): units that got only some of their gradients
  (parameters unused this step) reduce what they have, in reverse forward order so every rank
  issues the same collectives; every pending reduction lands in ``.grad``; units still
  gathered are freed; all states are reset.

Forward that runs *inside* backward (activation-checkpoint recomputation) only makes sure
parameters are gathered: nothing is freed and no hook is registered, because the backward
that triggered it is about to use them.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook

from shardline import _torch_compat
from shardline._tree import iter_tensors, map_tensors
from shardline.engine.unit import PendingReduce, ShardUnit, TrainingState

__all__ = ["ENGINE", "get_unit", "install_hooks", "on_grad_ready", "subtree_units"]

log = logging.getLogger(__name__)

UNIT_ATTR = "_shardline_unit"


class _Engine:
    """Process-wide bookkeeping shared by all units (hooks may run on autograd's threads)."""

    def __init__(self) -> None:
        self.forward_root: ShardUnit | None = None
        self.callback_queued = False
        self.touched: dict[int, ShardUnit] = {}  # units forwarded or backwarded since the last final callback
        self.pending: list[PendingReduce] = []
        self.order: dict[int, ShardUnit] = {}  # units in pre-forward order during the current root forward
        self.prefetched: dict[int, ShardUnit] = {}  # units with a gather in flight

    def prefetch(self, unit: ShardUnit | None, phase: str) -> None:
        if unit is not None and unit.prefetch(phase):
            self.prefetched[id(unit)] = unit

    def cancel_prefetches(self) -> None:
        prefetched, self.prefetched = self.prefetched, {}
        for unit in prefetched.values():
            unit.cancel_prefetch()

    def touch(self, unit: ShardUnit) -> None:
        self.touched.setdefault(id(unit), unit)

    def ensure_final_callback(self) -> None:
        if not self.callback_queued:
            self.callback_queued = True
            _torch_compat.queue_backward_callback(finalize_backward)

    def land_pending(self) -> None:
        pending, self.pending = self.pending, []
        for reduction in pending:
            reduction.finish()


ENGINE = _Engine()


def get_unit(module: nn.Module) -> ShardUnit | None:
    """The unit ``fully_shard`` made for ``module``, or None."""
    return module.__dict__.get(UNIT_ATTR)


def subtree_units(module: nn.Module) -> list[ShardUnit]:
    """Units of ``module`` and of all its descendants, in ``modules()`` order."""
    seen: dict[int, ShardUnit] = {}
    for m in module.modules():
        unit = get_unit(m)
        if unit is not None:
            seen.setdefault(id(unit), unit)
    return list(seen.values())


def install_hooks(unit: ShardUnit) -> None:
    """Attach the forward hooks that drive ``unit`` to its module."""
    module = unit.module
    module.register_forward_pre_hook(_PreForward(unit), prepend=True, with_kwargs=True)
    module.register_forward_hook(_PostForward(unit), always_call=True)
    module.__dict__[UNIT_ATTR] = unit


class _PreForward:
    __slots__ = ("unit",)

    def __init__(self, unit: ShardUnit) -> None:
        self.unit = unit

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        unit = self.unit
        if _torch_compat.in_backward():  # activation-checkpoint recomputation
            unit.unshard(phase="backward")
        else:
            if ENGINE.forward_root is None:
                ENGINE.forward_root = unit
                _root_pre_forward(unit)
            ENGINE.order.setdefault(id(unit), unit)
            unit.state = TrainingState.FORWARD
            ENGINE.prefetched.pop(id(unit), None)
            unit.unshard(phase="forward")
            if unit.forward_prefetch:
                ENGINE.prefetch(_neighbor(unit, +1), "forward")
        mp = unit.mixed_precision
        if mp.param_dtype is not None and mp.cast_forward_inputs:
            args, kwargs = map_tensors(_Cast(mp.param_dtype), (args, kwargs))
        return args, kwargs


class _PostForward:
    __slots__ = ("unit",)

    def __init__(self, unit: ShardUnit) -> None:
        self.unit = unit

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> Any:
        unit = self.unit
        if _torch_compat.in_backward():
            return output
        unit.state = TrainingState.IDLE
        if torch.is_grad_enabled():
            ENGINE.touch(unit)
            tensors = [t for t in iter_tensors(output) if t.requires_grad]
            if tensors:
                register_multi_grad_hook(tensors, _PreBackward(unit), mode="any")
            free = unit.reshard_after_forward and unit.sync_gradients and not unit.pinned
            if not free and unit.is_unsharded and not unit.pinned:
                unit.forward_leftover = True
        else:
            free = not unit.pinned
        if free:
            unit.reshard()
        if ENGINE.forward_root is unit:
            ENGINE.forward_root = None
            unit.set_forward_order(list(ENGINE.order.values()))
            ENGINE.order = {}
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
        ENGINE.ensure_final_callback()
        ENGINE.touch(unit)
        if unit.state is not TrainingState.POST_BACKWARD:
            unit.state = TrainingState.PRE_BACKWARD
        ENGINE.prefetched.pop(id(unit), None)
        unit.unshard(phase="backward")
        if unit.backward_prefetch == "backward_pre":
            ENGINE.prefetch(_neighbor(unit, -1), "backward")


class _Cast:
    __slots__ = ("dtype",)

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.dtype) if tensor.is_floating_point() else tensor


def _neighbor(unit: ShardUnit, step: int) -> ShardUnit | None:
    """The unit ``step`` places after ``unit`` in its root's forward order of the previous step."""
    root = unit.root
    if root is None or root.forward_order is None:
        return None
    position = root.forward_position.get(id(unit))
    if position is None:
        return None
    index = position + step
    return root.forward_order[index] if 0 <= index < len(root.forward_order) else None


def _root_pre_forward(root: ShardUnit) -> None:
    ENGINE.order = {}
    ENGINE.cancel_prefetches()
    if ENGINE.callback_queued:  # a backward raised before its final callback ran
        log.warning("shardline: the previous backward pass did not finish; resetting unit states")
        ENGINE.callback_queued = False
        ENGINE.pending.clear()
        for unit in ENGINE.touched.values():
            unit.reset_backward_state()
        ENGINE.touched.clear()
    if root.subtree is None:
        root.subtree = subtree_units(root.module)
    for unit in root.subtree:
        unit.root = root
        if unit.forward_leftover and unit.sync_gradients:
            unit.reshard()


def on_grad_ready(unit: ShardUnit, index: int) -> None:
    """Post-accumulate-grad hook of a gathered parameter: reduce once the unit is complete."""
    ENGINE.ensure_final_callback()
    ENGINE.touch(unit)
    if unit.mark_grad_ready(index) and not unit.post_backward_done:
        post_backward(unit)


def post_backward(unit: ShardUnit) -> None:
    """Reduce (or, under no_sync, keep) the unit's gradients and free its gathered parameters."""
    unit.post_backward_done = True
    unit.state = TrainingState.POST_BACKWARD
    if unit.sync_gradients:
        ENGINE.land_pending()  # bound in-flight reductions to one
        reduction = unit.reduce_gradients()
        if reduction is not None:
            ENGINE.pending.append(reduction)
    else:
        unit.accumulate_unsynced()
    if unit.policy.reshard_after_backward and unit.sync_gradients and not unit.pinned:
        unit.reshard()
    if unit.backward_prefetch == "backward_post":
        ENGINE.prefetch(_neighbor(unit, -1), "backward")


def finalize_backward() -> None:
    """End-of-backward callback: finish partial units, land every reduction, free and reset."""
    ENGINE.callback_queued = False
    units = list(ENGINE.touched.values())
    ENGINE.touched.clear()
    for unit in reversed(units):
        if not unit.post_backward_done and unit.has_unsharded_grads():
            post_backward(unit)
    ENGINE.land_pending()
    ENGINE.cancel_prefetches()
    for unit in units:
        if unit.sync_gradients and not unit.pinned:
            unit.reshard()
        unit.reset_backward_state()
