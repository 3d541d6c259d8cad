"""One sharded parameter: the local shard the optimizer sees and the gathered tensor forward uses."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from shardline.engine.layout import ParamLayout

__all__ = ["GATHERED_ATTR", "OWNER_ATTR", "REPLACED_ATTR", "ShardedParam", "alias"]

# Attributes set on parameter objects so misuse can be recognized later (see engine/guards.py).
OWNER_ATTR = "_shardline_owner"  # on originals and shards: (unit, fqn)
REPLACED_ATTR = "_shardline_replaced"  # on an original parameter fully_shard replaced: its name
GATHERED_ATTR = "_shardline_gathered"  # on a gathered (full) parameter: its name


def alias(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor sharing ``tensor``'s storage but with its own autograd version counter.

    Note: why not ``detach()``. Views and ``detach()`` share the version counter of their
    base, so writing into a unit's flat buffer (an all-gather landing, an optimizer step on a
    neighbouring shard) would bump the version of every parameter carved from it, and
    autograd would refuse to backward through a tensor "modified by an inplace operation".
    ``.data`` is the documented way to get an alias outside autograd's tracking.
    """
    return tensor.data


@dataclass(eq=False)
class ShardedParam:
    """An original parameter after sharding.

    Attributes:
        fqn: Name relative to the unit's module (its first registration when tied).
        locations: Every ``(module, attribute)`` it is registered under; several when tied.
        layout: Shape and this rank's rows.
        sharded: The ``nn.Parameter`` registered on the module between steps: this rank's rows,
            a view into the unit's flat shard buffer, in the master dtype.
        unsharded: The gathered parameter used by forward and backward (created lazily, reused
            every step so autograd graphs keep pointing at the same leaf).
        accumulated_grad: Gradient accumulated under ``no_sync`` in the reduce dtype when that
            is wider than the compute dtype.
        group: The :class:`~shardline.engine.flat.FlatGroup` (one per master dtype) holding the shard.
    """

    fqn: str
    locations: list[tuple[nn.Module, str]]
    layout: ParamLayout
    sharded: nn.Parameter
    unsharded: nn.Parameter | None = None
    accumulated_grad: torch.Tensor | None = None
    grad_ready: bool = field(default=False)
    hooked: bool = field(default=False)
    group: object = field(default=None, repr=False)  # the FlatGroup holding its shard (read it with flat_group)

    @property
    def global_shape(self) -> tuple[int, ...]:
        """The parameter's shape as DTensors and optimizer state show it: its shape, ``(1,)`` for 0-d."""
        return (self.layout.rows, *self.layout.row_shape)

    def register(self, tensor: nn.Parameter) -> None:
        """Make ``tensor`` the value of every attribute this parameter is registered under."""
        for module, name in self.locations:
            module._parameters[name] = tensor  # plain dict write: no __setattr__ checks

    def unsharded_grad(self) -> torch.Tensor | None:
        """The gradient of the gathered parameter accumulated so far (with any no_sync accumulator)."""
        grad = self.unsharded.grad if self.unsharded is not None else None
        acc = self.accumulated_grad
        if acc is None:
            return grad
        if grad is None:
            return acc
        return acc.add_(grad.to(acc.dtype))

    def clear_unsharded_grad(self) -> None:
        if self.unsharded is not None:
            self.unsharded.grad = None
        self.accumulated_grad = None
