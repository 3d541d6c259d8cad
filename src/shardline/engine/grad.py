"""Global gradient-norm clipping over sharded and replicated gradients."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from shardline.engine.registry import subtree_units
from shardline.errors import ConfigurationError

if TYPE_CHECKING:
    from shardline.engine.unit import ShardUnit

__all__ = ["clip_grad_norm_", "common_dp_root"]


def common_dp_root(units: list[ShardUnit], what: str) -> ShardUnit:
    """The first of ``units``, after checking that they all use the same data-parallel ranks.

    Raises:
        ConfigurationError: naming the two units whose groups differ and their ranks.
    """
    first = units[0]
    for unit in units[1:]:
        if not unit.mesh.same_dp_group(first.mesh):
            raise ConfigurationError(
                f"{what} needs every unit under the module to use the same data-parallel ranks, but "
                f"{first.display_name!r} uses {dist.get_process_group_ranks(first.mesh.dp_group)} and "
                f"{unit.display_name!r} uses {dist.get_process_group_ranks(unit.mesh.dp_group)}. Call it "
                "on each group of units separately."
            )
    return first


def clip_grad_norm_(
    module: nn.Module, max_norm: float, norm_type: float = 2.0, *, error_if_nonfinite: bool = False
) -> torch.Tensor:
    """Clip the gradients of every parameter under ``module`` by their global norm.

    Equal to ``torch.nn.utils.clip_grad_norm_`` on the unsharded model. Each rank computes the
    norm of the gradient pieces it *owns* -- its shards of sharded units, and replicated
    gradients only on the first rank of each replica group so nothing is counted twice -- and
    one all-reduce (sum of ``norm**p``, or max for ``inf``) over the data-parallel group
    combines them. Returns the total norm as a float32 tensor on the gradients' device.
    """
    norm_type = float(norm_type)
    if norm_type <= 0 and not math.isinf(norm_type):
        raise ConfigurationError(f"norm_type must be positive or inf, got {norm_type}")
    units = subtree_units(module)
    if not units:
        return torch.nn.utils.clip_grad_norm_(
            module.parameters(), max_norm, norm_type, error_if_nonfinite=error_if_nonfinite
        )
    first = common_dp_root(units, "clip_grad_norm_")
    params = [sp.sharded for unit in units for sp in unit.params if sp.sharded.grad is not None]
    owned = [
        sp.sharded.grad
        for unit in units
        if unit.mesh.replicate_rank == 0
        for sp in unit.params
        if sp.sharded.grad is not None and sp.sharded.grad.numel()  # empty shards: no identity for inf
    ]
    local = torch.nn.utils.get_total_norm(owned, norm_type, foreach=None).to(torch.float32)
    local = local.to(first.device) if first.device.type != "meta" else local
    if math.isinf(norm_type):
        total = local.clone()
        first.ctx.comm.all_reduce(
            total, first.mesh.dp_group, op=dist.ReduceOp.MAX, unit=first.display_name, phase="clip"
        )
    else:
        total = local.pow(norm_type)
        first.ctx.comm.all_reduce(total, first.mesh.dp_group, unit=first.display_name, phase="clip")
        total = total.pow(1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is non-finite ({total.item()}), so it "
            "cannot be clipped. Pass error_if_nonfinite=False to skip this check."
        )
    if params:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=None)
    return total
