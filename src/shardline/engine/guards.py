"""Misuse that would otherwise corrupt a sharded model silently, caught loudly.

* **An optimizer built before sharding** holds the original parameters, which ``fully_shard``
  replaced by shards: it would step tensors nothing reads, and the model would never train. A
  global optimizer step pre-hook refuses the first ``step()`` of such an optimizer (checked
  again only when its parameter count changes, so a step costs one comparison).
* **torch ``DistributedDataParallel`` around a sharded model** (what Lightning's ``ddp``
  strategy and the Hugging Face Trainer do) would broadcast rank 0's *shards* over every other
  rank's at construction and all-reduce shards as if they were replicas. Wrapping the sharded
  module itself makes DDP ignore every parameter shardline manages (DDP reads the module's
  ``_ddp_params_and_buffers_to_ignore``), or refuse with a clear error when nothing would be left
  for it. Wrapping an unsharded parent cannot be intercepted at construction, so the first
  forward looks for an enclosing ``DistributedDataParallel.forward`` and refuses if that DDP
  manages shards.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from shardline.engine.param import GATHERED_ATTR, REPLACED_ATTR
from shardline.engine.registry import subtree_units
from shardline.errors import ShardingError

if TYPE_CHECKING:
    from types import FrameType

    from shardline.engine.unit import ShardUnit

__all__ = ["check_not_inside_ddp", "ddp_ignored_names", "install_optimizer_guard"]

_CHECKED_COUNT = "_shardline_checked_params"
_DDP_CHECKED = "_shardline_checked"
_FRAMES = 48  # how far up the stack an enclosing DDP forward is looked for
_optimizer_guard_installed = False

_FRAMEWORK_HINT = (
    "Frameworks that wrap the model in DDP must be told not to: with Lightning use "
    "strategy=shardline.lightning.ShardlineStrategy(); otherwise run the sharded model unwrapped "
    "(shardline already averages gradients across ranks)."
)


# ---------------------------------------------------------------------- optimizers
def install_optimizer_guard() -> None:
    """Register (once per process) the optimizer step pre-hook that refuses stale parameters."""
    global _optimizer_guard_installed
    if not _optimizer_guard_installed:
        register_optimizer_step_pre_hook(_check_optimizer)
        _optimizer_guard_installed = True


def _check_optimizer(optimizer: torch.optim.Optimizer, _args: tuple[object, ...], _kwargs: dict[str, object]) -> None:
    count = sum(len(group["params"]) for group in optimizer.param_groups)
    if optimizer.__dict__.get(_CHECKED_COUNT) == count:
        return
    replaced, gathered = [], []
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = getattr(p, REPLACED_ATTR, None)
            if name is not None:
                replaced.append(name)
            elif getattr(p, GATHERED_ATTR, None) is not None:
                gathered.append(getattr(p, GATHERED_ATTR))
    if replaced:
        raise ShardingError(
            f"{type(optimizer).__name__} holds {len(replaced)} parameter(s) that fully_shard replaced by shards "
            f"(e.g. {', '.join(replaced[:3])}): it would update tensors the model no longer uses, and the model "
            "would never train. Build the optimizer after fully_shard / shardline.wrap, from model.parameters()."
        )
    if gathered:
        raise ShardingError(
            f"{type(optimizer).__name__} holds {len(gathered)} gathered (full) parameter(s) of a sharded model "
            f"(e.g. {', '.join(gathered[:3])}), taken while the model was unsharded: updates to them are not "
            "written back to the shards. Build the optimizer from model.parameters() between steps, when the "
            "shards are registered."
        )
    optimizer.__dict__[_CHECKED_COUNT] = count


# ---------------------------------------------------------------------- DDP
def ddp_ignored_names(module: nn.Module) -> list[str]:
    """FQNs (relative to ``module``) of every parameter shardline manages under ``module``.

    Raises:
        ShardingError: Nothing trainable would be left for DDP to manage: wrapping this model in
            DDP is a mistake (see the module docstring).
    """
    prefixes = {id(m): name for name, m in module.named_modules(remove_duplicate=False)}
    names: list[str] = []
    for unit in subtree_units(module):
        for sp in unit.params:
            for owner, attr in sp.locations:
                prefix = prefixes.get(id(owner))
                if prefix is not None:
                    names.append(f"{prefix}.{attr}" if prefix else attr)
    ignored = set(names)
    left = [n for n, p in module.named_parameters(remove_duplicate=False) if n not in ignored and p.requires_grad]
    if not left:
        raise ShardingError(
            f"torch DistributedDataParallel was asked to wrap a {_class_name(module)} sharded by shardline. "
            "Every trainable parameter is already sharded and synchronized by shardline, so DDP has nothing to do, "
            "and if it managed them it would overwrite other ranks' shards with rank 0's. " + _FRAMEWORK_HINT
        )
    return names


def _class_name(module: nn.Module) -> str:
    """The module's own class name (not the ``Sharded*`` subclass fully_shard swaps in)."""
    cls = type(module)
    sharded = cls.__name__.startswith("Sharded") and len(cls.__bases__) == 2
    return cls.__bases__[-1].__name__ if sharded else cls.__name__


def check_not_inside_ddp(root: ShardUnit) -> None:
    """Refuse to run forward under a ``DistributedDataParallel`` that manages this tree's shards."""
    ddp_class = torch.nn.parallel.DistributedDataParallel
    code = ddp_class.forward.__code__
    frame: FrameType | None = sys._getframe(1)
    for _ in range(_FRAMES):
        if frame is None:
            return
        if frame.f_code is code:
            ddp = frame.f_locals.get("self")
            if isinstance(ddp, ddp_class) and not ddp.__dict__.get(_DDP_CHECKED):
                _check_ddp(ddp)
            return
        frame = frame.f_back


def _check_ddp(ddp: nn.Module) -> None:
    ignore = set(getattr(ddp, "parameters_to_ignore", ()))
    managed = [
        name
        for name, p in ddp.module.named_parameters(remove_duplicate=False)  # type: ignore[union-attr]
        if name not in ignore and p.requires_grad and getattr(p, "_shardline_owner", None) is not None
    ]
    if managed:
        raise ShardingError(
            f"this sharded model runs inside torch DistributedDataParallel, which manages {len(managed)} of "
            f"shardline's sharded parameters (e.g. {', '.join(managed[:3])}). DDP broadcast rank 0's shards over "
            "the other ranks' when it was built (rebuild the model: those weights are no longer this rank's "
            "rows) and would all-reduce shards as if they were replicas. Shard the root too (shardline.wrap does), "
            "or, to leave the unsharded rest to DDP, set model._ddp_params_and_buffers_to_ignore = "
            "shardline.engine.ddp_ignored_names(model) before building DDP. " + _FRAMEWORK_HINT
        )
    ddp.__dict__[_DDP_CHECKED] = True
