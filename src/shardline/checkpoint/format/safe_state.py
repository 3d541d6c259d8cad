"""Trainer state a ``weights_only`` load restores for certain, recognised without loading it back.

Note: why a save checks trainer state by its types first. Checkpoints are read with
``torch.load(weights_only=True)``, so every save proves that its trainer state loads that way
(:func:`~.dcp_io.encode_state`): an arbitrary class, a numpy array, a tensor subclass would
otherwise be saved and fail only at resume. Loading the bytes back on every save costs about
four times the ``torch.save`` itself (about 0.7 ms for a trainer's usual RNG states, step and
scheduler numbers). Almost every trainer state is made only of the types below, which the safe
loader always restores; :func:`plainly_safe` recognises such a state by walking it once, and only
a state holding anything else (or too deep, or with a cycle) is loaded back as before, so the
error a user sees for an unsafe state is unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["plainly_safe"]

# Exact types (no subclasses: a subclass pickles as its own class, which a weights_only load refuses).
_ATOMS = frozenset({type(None), bool, int, float, complex, str, bytes})
_CONTAINERS = frozenset({dict, list, tuple})
_MAX_DEPTH = 64


def _plain_tensor(value: torch.Tensor) -> bool:
    # A plain dense CPU tensor pickles through torch's own rebuild function, which the safe loader allows; anything
    # with extra Python attributes, names, a quantizer or another layout is left to the load.
    return (
        type(value) is torch.Tensor
        and value.layout == torch.strided
        and value.device.type == "cpu"
        and not value.is_quantized
        and not value.__dict__
        and all(name is None for name in getattr(value, "names", None) or ())  # named tensors: gone from newer torch
    )


def plainly_safe(obj: Any) -> bool:
    """True if ``obj`` holds only dicts, lists and tuples of None, bools, numbers, strings, bytes and plain CPU
    tensors, with dict keys of those atoms: state a ``torch.load(weights_only=True)`` restores for certain.

    False means "not recognised" (check by loading it back), not "unsafe".
    """
    open_containers: set[int] = set()

    def walk(value: Any, depth: int) -> bool:
        kind = type(value)
        if kind in _ATOMS:
            return True
        if kind is torch.Tensor:
            return _plain_tensor(value)
        if kind not in _CONTAINERS or depth >= _MAX_DEPTH or id(value) in open_containers:
            return False
        open_containers.add(id(value))
        try:
            if kind is dict:
                return all(type(k) in _ATOMS and walk(v, depth + 1) for k, v in value.items())
            return all(walk(v, depth + 1) for v in value)
        finally:
            open_containers.discard(id(value))

    return walk(obj, 0)
