"""``trainer.compile``: compile each sharded unit with ``torch.compile``, the way sharded models are compiled."""

from __future__ import annotations

import torch
from torch import nn

from shardline.engine import subtree_units
from shardline.errors import ConfigurationError

__all__ = ["check_compile_supported", "compile_units"]


def check_compile_supported(*, device_type: str) -> None:
    """Refuse, before anything is compiled, compiling for CPU under the ``default`` CPU kernel set.

    With ``ATEN_CPU_CAPABILITY=default`` (torch's kernels without vector instructions) inductor's
    generated C++ does not build (seen with torch 2.13: "'at::vec' has not been declared"), and
    the failure comes out of the first forward pass as a long compiler log. It is a property of
    the process (workers inherit the variable), so the launcher checks it before any worker
    starts, and :func:`compile_units` again for library use.

    Raises:
        ConfigurationError: ``device_type`` is ``cpu`` while torch runs the ``default`` kernel set.
    """
    if device_type == "cpu" and torch.backends.cpu.get_cpu_capability().lower() == "default":
        raise ConfigurationError(
            f"trainer.compile=true on CPU with the default kernel set (ATEN_CPU_CAPABILITY=default): inductor's "
            f"generated C++ does not build there (torch {torch.__version__}); unset ATEN_CPU_CAPABILITY or set it "
            f"to avx2/avx512, or train eagerly with trainer.compile=false"
        )


def compile_units(model: nn.Module) -> list[nn.Module]:
    """Compile (``module.compile()``, in place) the outermost units below the root; returns their modules.

    Each unit's forward becomes one graph over its gathered parameters, and the engine's hooks run
    eagerly around it (see the note on torch.compile in ``shardline/engine/hooks.py``). The root
    unit's own forward loops over the units, so compiling it would break its graph at every unit
    and compile nothing more; it stays eager. A model that is one unit, or is not sharded at all
    (one device), is compiled whole.

    Raises:
        ConfigurationError: where compiling cannot work (:func:`check_compile_supported`).
    """
    for device_type in sorted({p.device.type for p in model.parameters()}):
        check_compile_supported(device_type=device_type)
    units = [u.module for u in subtree_units(model) if u.module is not model]
    inner = {id(m) for unit in units for m in unit.modules() if m is not unit}
    targets = [m for m in units if id(m) not in inner] or [model]  # a unit inside a compiled unit is compiled with it
    for module in targets:
        module.compile()
    return targets
