"""Capture and restore every random-number generator a training step may draw from.

The captured state is plain data (tensors, ints, tuples), so it can go into a checkpoint's
``state["per_rank"]`` and be read back with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import random
from typing import Any, cast

import torch

__all__ = ["capture_rng_state", "restore_rng_state"]


def capture_rng_state() -> dict[str, Any]:
    """This process's RNG states: torch CPU, every CUDA device (if any), Python ``random``, NumPy (if installed)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())]
    try:
        import numpy as np
    except ImportError:  # numpy is optional for this
        return state
    # The global RandomState is an MT19937, whose legacy state is this tuple (a dict is for other bit generators).
    legacy = cast("tuple[str, np.ndarray, int, int, float]", np.random.get_state(legacy=True))
    kind, keys, pos, has_gauss, cached = legacy
    state["numpy"] = (str(kind), torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached))
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng_state` (generators absent from ``state`` are left alone)."""
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        for i, s in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, i)
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
