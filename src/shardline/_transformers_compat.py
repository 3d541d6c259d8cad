"""The one place where shardline depends on transformers' Trainer internals (and the Accelerate calls Trainer makes).

``shardline.hf`` overrides a few of ``transformers.Trainer``'s methods, four of them private,
and reads two of Trainer's file-name constants. Everything version-dependent about that is
here. When this module is first imported it checks the installed transformers once: its version
against :data:`SUPPORTED_TRANSFORMERS`, and the leading parameters of every overridden method
(:data:`TRAINER_OVERRIDES`) and of Accelerate's ``prepare_model``. A release that moved any of
them fails there, with one error naming each difference, the installed version and the
supported range, instead of a ``TypeError`` (or an incomplete checkpoint) mid-training.

Note: why a range with an upper bound. Each override names only the leading parameters it
reads and passes everything else on (``*args, **kwargs``), which survives the releases that
add parameters. A new major release may move what the overrides rely on without changing a
signature (when Trainer calls them, what a checkpoint folder holds), so it is refused until it
has been run (``nox -s compat``, docs/testing.md).
"""

from __future__ import annotations

import inspect
from typing import Any

import accelerate
import transformers
from accelerate import Accelerator
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from transformers import Trainer
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from shardline.errors import ConfigurationError

__all__ = [
    "PREFIX_CHECKPOINT_DIR",
    "SUPPORTED_TRANSFORMERS",
    "TRAINER_OVERRIDES",
    "TRAINER_STATE_NAME",
    "check_trainer_class",
]

SUPPORTED_TRANSFORMERS = ">=4.56.2,<6"
"""The transformers releases shardline's Trainer integration supports (pyproject's ``hf`` extra declares the same).

4.56.2 is the floor because TRL 1.0, the oldest TRL the ``hf`` extra allows, requires it; the
releases run are in docs/testing.md."""

TRAINER_OVERRIDES: dict[str, tuple[str, ...]] = {
    "create_accelerator_and_postprocess": (),
    "train": ("resume_from_checkpoint",),
    "save_model": ("output_dir",),
    "_save_checkpoint": ("model", "trial"),
    "_save_optimizer_and_scheduler": ("output_dir",),
    "_load_from_checkpoint": ("resume_from_checkpoint",),
    "_load_optimizer_and_scheduler": ("checkpoint",),
    "_load_best_model": (),
}
"""Each Trainer method ``shardline.hf`` overrides, with the leading parameters its override reads."""

_ACCELERATOR_PREPARE_MODEL = ("model", "device_placement", "evaluation_mode")
"""What ``shardline.hf.accelerator`` passes to ``Accelerator.prepare_model`` (positionally and by name)."""


def _leading_parameters(method: Any) -> list[str | None] | None:
    """The positional parameters of ``method`` after ``self`` (None stands for ``*args``), or None if unreadable."""
    try:
        params = list(inspect.signature(method).parameters.values())[1:]
    except (TypeError, ValueError):
        return None  # no signature to read (a builtin): nothing to compare
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names: list[str | None] = []
    for p in params:
        if p.kind == inspect.Parameter.VAR_POSITIONAL:
            names.append(None)  # forwards any further positional parameter
            break
        if p.kind in positional:
            names.append(p.name)
    return names


def _mismatch(method: Any, expected: tuple[str, ...]) -> str | None:
    """None if ``method``'s positional parameters after ``self`` begin with ``expected`` (a ``*args`` takes the
    rest); else how its parameters read, for a message."""
    names = _leading_parameters(method)
    if names is None:
        return None
    for i, name in enumerate(expected):
        if i >= len(names) or names[i] not in (name, None):
            return ", ".join("*args" if n is None else n for n in names)
        if names[i] is None:
            break
    return None


def _signature_problems(trainer_cls: type) -> list[str]:
    problems = []
    for name, expected in TRAINER_OVERRIDES.items():
        method = getattr(trainer_cls, name, None)
        if not callable(method):
            problems.append(f"{name} is missing")
            continue
        found = _mismatch(method, expected)
        if found is not None:
            problems.append(f"{name}({found}), where shardline overrides {name}({', '.join(expected)}, ...)")
    return problems


def _install_hint() -> str:
    return (
        f"shardline supports transformers {SUPPORTED_TRANSFORMERS}: install a release in that range "
        f"(pip install 'transformers{SUPPORTED_TRANSFORMERS}'), or a shardline release that supports "
        f"{transformers.__version__}."
    )


def check_trainer_class(trainer_cls: type) -> None:
    """Refuse ``trainer_cls`` if a Trainer method shardline overrides is missing or its leading parameters moved.

    Raises:
        ConfigurationError: naming each method, the parameters expected and found, the installed
            transformers and :data:`SUPPORTED_TRANSFORMERS`.
    """
    problems = _signature_problems(trainer_cls)
    if problems:
        listed = "\n".join(f"  - {p}" for p in problems)
        raise ConfigurationError(
            f"shardline's Trainer integration does not fit {trainer_cls.__module__}.{trainer_cls.__qualname__} "
            f"with the installed transformers {transformers.__version__}; it overrides these methods and found:\n"
            f"{listed}\n{_install_hint()}"
            + (
                ""
                if trainer_cls is Trainer
                else f" If {trainer_cls.__name__} is your own subclass, keep Trainer's leading parameters."
            )
        )


def _check_installed() -> None:
    """The installed transformers (and Accelerate's ``prepare_model``) against what shardline supports.

    Raises:
        ConfigurationError: one message naming every difference, the installed versions and the supported range.
    """
    installed = Version(transformers.__version__)
    if installed not in SpecifierSet(SUPPORTED_TRANSFORMERS, prereleases=True):
        raise ConfigurationError(
            f"shardline's Trainer integration does not support the installed transformers {installed}. "
            + _install_hint()
        )
    check_trainer_class(Trainer)
    found = _mismatch(Accelerator.prepare_model, _ACCELERATOR_PREPARE_MODEL)
    if found is not None:
        raise ConfigurationError(
            f"shardline's Trainer integration does not fit the installed accelerate {accelerate.__version__} "
            f"(with transformers {installed}): Accelerator.prepare_model({found}), where shardline calls "
            f"prepare_model({', '.join(_ACCELERATOR_PREPARE_MODEL)}). Install the accelerate release your "
            f"transformers asks for (pip install 'shardline[hf]' picks one)."
        )


_check_installed()  # once, at the first import of shardline.hf
