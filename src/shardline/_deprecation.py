"""Names a package no longer exports, still importable from it for one release with a DeprecationWarning.

Note: a package keeps a table ``{old name: "new.module"}`` and sets ``__getattr__ = moved_names(__name__, table)``;
Python calls that hook only for names the module does not define, so the package's own exports are untouched and
the moved ones cost nothing until someone asks for them. The object returned is the one the new home holds (the
same object, not a copy), so ``isinstance`` checks and identity comparisons keep working during the deprecation.
``defined_in`` names where a name is fetched from when that is not the advertised home: a lower-layer package
whose names moved to a higher one (``shardline.checkpoint`` -> ``shardline.testing``, which re-exports them)
fetches them from their defining module, so the hook never imports upwards.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping

__all__ = ["REMOVED_IN", "moved_names"]

REMOVED_IN = "the next minor release"


def moved_names(
    package: str, moved: Mapping[str, str], *, defined_in: Mapping[str, str] | None = None, private: bool = False
) -> Callable[[str], object]:
    """A module ``__getattr__`` for ``package`` that serves each name of ``moved`` from its new module, warning.

    ``moved`` maps a name to the module users should import it from; ``defined_in`` (optional, per name) to the
    module it is read from, when that differs. ``private``: the new home is not a public API (the warning says so
    rather than inviting an import from it).

    Raises (from the hook):
        AttributeError: a name that is neither the package's nor a moved one (the usual error).
    """
    table = dict(moved)
    source = {name: (defined_in or {}).get(name, home) for name, home in table.items()}

    def __getattr__(name: str) -> object:
        home = table.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        where = (
            f"is internal (it moved to {home}, which is not a public API)"
            if private
            else f"moved to {home}.{name}; import it from there"
        )
        warnings.warn(
            f"{package}.{name} {where}; {package} stops providing it in {REMOVED_IN}",
            DeprecationWarning,
            stacklevel=2,
        )
        value: object = getattr(importlib.import_module(source[name]), name)
        return value

    return __getattr__
