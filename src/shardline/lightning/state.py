"""A Lightning checkpoint dict as shardline trainer state: plain data only, and back.

shardline checkpoints read trainer state with ``torch.load(weights_only=True)`` -- a checkpoint
can only ever produce data. Lightning's checkpoint dict is mostly plain already (loop progress,
callback states, scheduler states, hyper-parameters); :func:`plain_state` converts the rest
(``AttributeDict`` and other mappings, paths, enums, classes, OmegaConf containers, numpy
values) and names the key of anything it cannot convert.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from omegaconf import Container, OmegaConf

from shardline.errors import ConfigurationError

__all__ = ["plain_state"]


def plain_state(obj: Any, where: str = "checkpoint") -> Any:
    """``obj`` with every value turned into tensors, numbers, strings, bytes, None, dicts, lists and tuples.

    Raises:
        ConfigurationError: a value of another type (the message names its key).
    """
    if obj is None or isinstance(obj, (bool, int, float, str, bytes, torch.Tensor)):
        return obj
    if isinstance(obj, Mapping):
        return {k if isinstance(k, (str, int)) else str(k): plain_state(v, f"{where}[{k!r}]") for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [plain_state(v, f"{where}[{i}]") for i, v in enumerate(obj)]
        return tuple(items) if isinstance(obj, tuple) else items
    if isinstance(obj, (os.PathLike, enum.Enum)):
        return os.fspath(obj) if isinstance(obj, os.PathLike) else plain_state(obj.value, where)
    if isinstance(obj, type):
        return f"{obj.__module__}.{obj.__qualname__}"
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(obj))
    if isinstance(obj, Container):
        return plain_state(OmegaConf.to_container(obj, resolve=True), where)
    raise ConfigurationError(
        f"{where} holds a {type(obj).__module__}.{type(obj).__qualname__}, which a shardline checkpoint cannot store "
        "safely (its trainer state is read with torch.load(weights_only=True)). Store plain values there (numbers, "
        "strings, tensors, lists, dicts), e.g. in on_save_checkpoint or save_hyperparameters."
    )
