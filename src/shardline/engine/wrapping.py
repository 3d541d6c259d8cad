"""Wrap policies: which submodules become units, and sharding a whole model with one call."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from torch import nn

from shardline.engine.api import fully_shard, original_class
from shardline.engine.registry import get_unit
from shardline.engine.traversal import post_order
from shardline.errors import ConfigurationError, PolicyMatchError

__all__ = ["LayerPolicy", "check_policy_matches", "layer_policy", "resolve_class", "wrap"]

M = TypeVar("M", bound=nn.Module)


def resolve_class(path: str) -> type:
    """Import ``"package.module.ClassName"`` and return the class, with errors that say what failed."""
    if not isinstance(path, str) or "." not in path.strip(". "):
        raise ConfigurationError(
            f"expected a dotted class path such as 'torch.nn.TransformerEncoderLayer', got {path!r}"
        )
    module_path, _, attr = path.strip().rpartition(".")
    try:
        module = importlib.import_module(module_path)
    except ImportError as exc:
        raise ConfigurationError(
            f"cannot import module '{module_path}' for class path '{path}': {exc}. Check the spelling and "
            "that the package providing it is installed."
        ) from exc
    try:
        obj = getattr(module, attr)
    except AttributeError:
        public = sorted(n for n in dir(module) if n[:1].isupper())
        raise ConfigurationError(
            f"module '{module_path}' has no attribute '{attr}' (class path '{path}'). Classes it defines: "
            f"{', '.join(public[:30]) or 'none'}."
        ) from None
    if not isinstance(obj, type):
        raise ConfigurationError(f"'{path}' is a {type(obj).__name__}, not a class")
    return obj


@dataclass(frozen=True)
class LayerPolicy:
    """Matches modules that are instances of any of ``classes`` (see :func:`layer_policy`)."""

    classes: tuple[type[nn.Module], ...]

    def __call__(self, module: nn.Module) -> bool:
        return isinstance(module, self.classes)

    def __repr__(self) -> str:
        return f"layer_policy({', '.join(c.__name__ for c in self.classes)})"


def layer_policy(*classes: type[nn.Module] | str) -> LayerPolicy:
    """A wrap policy matching modules of the given classes (class objects or dotted import paths).

    >>> policy = layer_policy("transformers.models.llama.modeling_llama.LlamaDecoderLayer")
    """
    if not classes:
        raise ConfigurationError("layer_policy needs at least one class or dotted class path")
    resolved: list[type[nn.Module]] = []
    for item in classes:
        cls = resolve_class(item) if isinstance(item, str) else item
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise ConfigurationError(f"layer_policy expects nn.Module subclasses, got {item!r}")
        resolved.append(cls)
    return LayerPolicy(tuple(resolved))


def check_policy_matches(
    model: nn.Module, policy: Callable[[nn.Module], bool], *, purpose: str
) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every module below the root matching ``policy``, innermost first.

    Raises:
        PolicyMatchError: Nothing matched. The message names the policy and lists the model's
            module classes, so a misspelled or wrong class is easy to spot.
    """
    matched = [(name, m) for name, m in post_order(model) if m is not model and policy(m)]
    if not matched:
        classes = sorted({original_class(m).__name__ for m in model.modules()})
        consequence = (
            "the model would be one single unit and nothing would be sharded per layer"
            if purpose == "wrap"
            else "nothing would be affected"
        )
        raise PolicyMatchError(
            f"{purpose} policy {policy!r} matched no module of {original_class(model).__name__}, so {consequence}. "
            f"The model's module classes are: {', '.join(classes)}. Pass the class of its repeated blocks "
            "to layer_policy()."
        )
    return matched


def wrap(
    model: M,
    policy: Callable[[nn.Module], bool],
    *,
    root_kwargs: Mapping[str, Any] | None = None,
    **fully_shard_kwargs: Any,
) -> M:
    """Shard every module matching ``policy`` (innermost first), then the root ``model``.

    Args:
        model: The model; it becomes the root unit.
        policy: A callable ``module -> bool``, typically :func:`layer_policy`.
        root_kwargs: Overrides of ``fully_shard_kwargs`` for the root unit only (e.g.
            ``{"strategy": "no_shard"}``).
        **fully_shard_kwargs: Passed to every :func:`fully_shard` call.

    Raises:
        PolicyMatchError: The policy matched no module besides the root. The message lists the
            model's module classes, so a misspelled or wrong class is easy to spot.
    """
    matched = check_policy_matches(model, policy, purpose="wrap")
    for name, module in matched:
        if get_unit(module) is None:
            fully_shard(module, **fully_shard_kwargs)
            unit = get_unit(module)
            assert unit is not None  # fully_shard made it
            unit.name = name
    fully_shard(model, **{**fully_shard_kwargs, **(root_kwargs or {})})
    return model
