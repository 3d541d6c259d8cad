"""Tiny helpers to walk and rebuild nested containers of tensors (module inputs and outputs).

A unit's forward may take or return tuples, lists, dicts (including ``OrderedDict``
subclasses such as Hugging Face ``ModelOutput``), named tuples and dataclasses, arbitrarily
nested. torch's own pytree module is private, so these cover what module I/O needs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

__all__ = ["iter_tensors", "map_tensors"]


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Yield every tensor inside ``obj``, depth first, in container order."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from iter_tensors(item)
    elif isinstance(obj, Mapping):
        for item in obj.values():
            yield from iter_tensors(item)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, field.name))


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], obj: Any) -> Any:
    """Return ``obj`` with every tensor replaced by ``fn(tensor)``; containers are rebuilt.

    Objects that are not containers we know are returned unchanged (not copied).
    """
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # named tuple
        return type(obj)(*(map_tensors(fn, item) for item in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(fn, item) for item in obj)
    if isinstance(obj, Mapping):
        mapped = {key: map_tensors(fn, value) for key, value in obj.items()}
        try:
            return type(obj)(mapped)  # type: ignore[call-arg]  # a Mapping subclass, rebuilt from a dict
        except TypeError:
            return mapped
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: map_tensors(fn, getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changes)
    return obj
