""" "Did you mean" for config nodes that fail to build: a misspelled ``_target_`` or keyword argument.

The schema catches a misspelled key in the typed parts of the config; the free-form nodes (the
model, callbacks, policies) are only checked when they are built. These helpers turn the two
common failures there into the same kind of one-line hint: a class path whose last part does
not exist, and an unexpected keyword argument, each with the closest valid name.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import re
from typing import Any

__all__ = ["keyword_hint", "target_hint"]

_UNEXPECTED = re.compile(r"(?:(?P<owner>[A-Za-z_][\w.]*)\(\) )?got an unexpected keyword argument '(?P<name>\w+)'")


def _signature_names(obj: Any) -> list[str] | None:
    """Keyword parameter names of a callable, or None if it takes ``**kwargs`` (any name) or has no signature."""
    try:
        params = inspect.signature(obj).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"]


def _resolve(path: str) -> Any:
    module_path, _, attr = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_path), attr)
    except (ImportError, AttributeError, ValueError):
        return None


def keyword_hint(target: str | None, error: BaseException) -> str:
    """For ``TypeError: X() got an unexpected keyword argument 'k'``: the closest accepted name and the list.

    The accepted names come from ``target``'s signature, or -- when it forwards ``**kwargs`` --
    from the callable the error names (``GPTConfig.__init__()``), looked up in ``target``'s module.
    """
    match = _UNEXPECTED.search(str(error))
    if not match or not target:
        return ""
    obj = _resolve(target)
    names = _signature_names(obj) if obj is not None else None
    owner = match.group("owner")
    if names is None and owner and obj is not None:
        module = importlib.import_module(obj.__module__) if hasattr(obj, "__module__") else None
        inner: Any = module
        for part in owner.removesuffix(".__init__").split("."):
            inner = getattr(inner, part, None)
        names = _signature_names(inner) if inner is not None else None
    if not names:
        return ""
    close = difflib.get_close_matches(match.group("name"), names, n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    return f".{hint} Accepted arguments: {', '.join(names)}."


def target_hint(target: str | None) -> str:
    """For a ``_target_`` that does not resolve: the closest name in its module, or how to make it importable."""
    if not target or "." not in target:
        return ""
    parts = target.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module_path = ".".join(parts[:cut])
        try:
            module = importlib.import_module(module_path)
        except ImportError:
            continue
        obj: Any = module
        for i, part in enumerate(parts[cut:]):
            nxt = getattr(obj, part, None)
            if nxt is None:
                public = [n for n in dir(obj) if not n.startswith("_")]
                close = difflib.get_close_matches(part, public, n=1)
                where = ".".join(parts[: cut + i])
                if close:
                    return f" Did you mean '{where}.{close[0]}'?"
                return f" '{where}' has no attribute '{part}'."
            obj = nxt
        return ""
    return (
        f" Module '{parts[0]}' cannot be imported: install it, or put the folder that holds it on PYTHONPATH "
        f"(e.g. PYTHONPATH=. shardline train ...; the current directory is not searched by the shardline command)."
    )
