"""The hooks ``shardline train`` calls on its callbacks, and the check that a callback names only those.

A callback is any object with some of the :data:`HOOKS` methods (hydra builds whatever
``callbacks.<name>._target_`` names; :class:`~shardline.train.callbacks.Callback` is an optional
base class that gives them their typed signatures). The trainer calls each hook a callback has,
by name, so a misspelt hook (``on_step_ended``) would simply never be called. :func:`check_callback`
refuses it instead: every public ``on_*`` method of a callback must be one of :data:`HOOKS`. It
runs where callbacks are built (the launcher's preflight, before any worker starts) and when a
:class:`~shardline.train.trainer.Trainer` is made.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Sequence
from typing import Literal, get_args

from shardline.errors import ConfigurationError

__all__ = ["HOOKS", "Hook", "check_callback", "check_callbacks"]

Hook = Literal[
    "on_fit_start",
    "on_train_batch_start",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_train_batch_end",
    "on_step_end",
    "on_validation_end",
    "on_fit_end",
    "on_exception",
]
"""The name of a hook the training loop calls (docs/training.md, "Callbacks", says when)."""

HOOKS: tuple[Hook, ...] = get_args(Hook)
"""Every hook, in the order a run calls them (``on_exception`` only when it fails)."""


def _hook_like_names(callback: object) -> list[str]:
    """The public ``on_*`` methods of ``callback`` (its class's and any set on the instance)."""
    names = []
    for name in dir(callback):
        if not name.startswith("on_"):
            continue
        value = inspect.getattr_static(callback, name, None)
        if callable(value) or isinstance(value, (staticmethod, classmethod)):
            names.append(name)
    return names


def check_callback(callback: object, *, where: str) -> None:
    """Raise if ``callback`` has an ``on_*`` method that is not a hook (it would never be called).

    Raises:
        ConfigurationError: naming ``where`` (e.g. ``callbacks.mine``), the callback's class, each
            unknown method with the closest hook, and every hook there is.
    """
    unknown = [name for name in _hook_like_names(callback) if name not in HOOKS]
    if not unknown:
        return
    described = []
    for name in unknown:
        close = difflib.get_close_matches(name, HOOKS, n=1, cutoff=0.6)
        described.append(f"{name} (did you mean {close[0]}?)" if close else name)
    cls = type(callback)
    raise ConfigurationError(
        f"{where} ({cls.__module__}.{cls.__qualname__}) has {'methods' if len(unknown) > 1 else 'a method'} "
        f"{', '.join(described)} that the trainer never calls: a callback's on_* methods must be hooks. "
        f"The hooks are {', '.join(HOOKS)}; rename the method, or drop the on_ prefix of a helper."
    )


def check_callbacks(callbacks: Sequence[object], *, where: str = "callbacks") -> None:
    """:func:`check_callback` for each of ``callbacks`` (named ``where[i]``)."""
    for i, callback in enumerate(callbacks):
        check_callback(callback, where=f"{where}[{i}]")
