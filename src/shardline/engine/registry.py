"""Which unit manages which module: the lowest layer of the engine, importing none of it.

``fully_shard`` stores the unit it makes in the module's ``__dict__``; everything else finds
units from a module tree with these functions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from shardline.engine.unit import ShardUnit

__all__ = ["UNIT_ATTR", "get_unit", "set_unit", "subtree_units"]

UNIT_ATTR = "_shardline_unit"


def get_unit(module: nn.Module) -> ShardUnit | None:
    """The unit ``fully_shard`` made for ``module``, or None."""
    return module.__dict__.get(UNIT_ATTR)


def set_unit(module: nn.Module, unit: ShardUnit) -> None:
    """Record ``unit`` as the one managing ``module``."""
    module.__dict__[UNIT_ATTR] = unit


def subtree_units(module: nn.Module) -> list[ShardUnit]:
    """Units of ``module`` and of all its descendants, in ``modules()`` order."""
    seen: dict[int, ShardUnit] = {}
    for m in module.modules():
        unit = get_unit(m)
        if unit is not None:
            seen.setdefault(id(unit), unit)
    return list(seen.values())
