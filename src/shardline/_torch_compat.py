"""The one place where shardline touches torch internals or version-dependent APIs.

A torch upgrade that moves any of these should only require edits in this file.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "all_gather_into",
    "in_backward",
    "queue_backward_callback",
    "reduce_scatter_into",
]

# torch 2.13 renamed the single-tensor collectives (``*_into_tensor`` -> ``*_single``) and
# deprecated the old names; torch 2.6 only has the old ones.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_into(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False) -> Any:
    """All-gather ``input`` from every rank of ``group`` into ``output`` (rank-major)."""
    return _all_gather(output, input, group=group, async_op=async_op)


def reduce_scatter_into(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    async_op: bool = False,
) -> Any:
    """Reduce ``input`` (rank-major) over ``group`` and keep this rank's slice in ``output``."""
    return _reduce_scatter(output, input, op=op, group=group, async_op=async_op)


def in_backward() -> bool:
    """True while the autograd engine is executing a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the current backward pass has finished all its nodes.

    Must be called from inside a backward pass (a hook). There is no public API for this;
    torch's own FSDP uses the same engine entry point.
    """
    torch.autograd.Variable._execution_engine.queue_callback(callback)
