"""Named ranges in ``torch.profiler`` traces for the engine's work (free when not profiling)."""

from __future__ import annotations

import contextlib

from torch.autograd.profiler import record_function

from shardline import _torch_compat

__all__ = ["label"]


def label(name: str) -> contextlib.AbstractContextManager[object]:
    """A ``torch.profiler`` range named ``shardline::<name>`` while profiling; free otherwise."""
    if _torch_compat.profiling_enabled():
        return record_function(f"shardline::{name}")
    return contextlib.nullcontext()
