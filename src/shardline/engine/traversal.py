"""Module-tree traversal orders shared by wrapping and initialization."""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

__all__ = ["post_order"]


def post_order(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """``(fqn, module)`` for ``module`` and its descendants, children before parents.

    Children come in registration order; a module registered twice is visited once.
    """
    seen: set[int] = set()

    def walk(m: nn.Module, name: str) -> Iterator[tuple[str, nn.Module]]:
        if id(m) in seen:
            return
        seen.add(id(m))
        for child_name, child in m.named_children():
            yield from walk(child, f"{name}.{child_name}" if name else child_name)
        yield name, m

    yield from walk(module, prefix)
