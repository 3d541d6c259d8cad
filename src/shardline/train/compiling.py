"""``trainer.compile``: compile each sharded unit with ``torch.compile``, the way sharded models are compiled."""

from __future__ import annotations

from torch import nn

from shardline.engine import subtree_units

__all__ = ["compile_units"]


def compile_units(model: nn.Module) -> list[nn.Module]:
    """Compile (``module.compile()``, in place) the outermost units below the root; returns their modules.

    Each unit's forward becomes one graph over its gathered parameters, and the engine's hooks run
    eagerly around it (see the note on torch.compile in ``shardline/engine/hooks.py``). The root
    unit's own forward loops over the units, so compiling it would break its graph at every unit
    and compile nothing more; it stays eager. A model that is one unit, or is not sharded at all
    (one device), is compiled whole.
    """
    units = [u.module for u in subtree_units(model) if u.module is not model]
    inner = {id(m) for unit in units for m in unit.modules() if m is not unit}
    targets = [m for m in units if id(m) not in inner] or [model]  # a unit inside a compiled unit is compiled with it
    for module in targets:
        module.compile()
    return targets
