"""Finding the store of a location, and naming locations: the storage seam's entry points.

Callers outside ``checkpoint/storage/`` turn text into a location with :func:`locate`, ask
:func:`store_for` for the :class:`~.protocol.CheckpointStore` that answers for it, and use the few
helpers here for what is asked of any location (how a message or the ledger names it, whether it
is a local path). This is the one place that tells the backends apart.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, cast

from shardline.checkpoint.storage.local import LocalStore
from shardline.checkpoint.storage.object_store import ObjectStore
from shardline.checkpoint.storage.objects import ObjectPath, as_location, is_url
from shardline.checkpoint.storage.protocol import CheckpointStore, Location

__all__ = [
    "LOCAL",
    "OBJECTS",
    "Locations",
    "check_reachable",
    "describe",
    "ledger_name",
    "local_path",
    "locate",
    "sorted_locations",
    "store_for",
]

LOCAL = LocalStore()
OBJECTS = ObjectStore()


class Locations:
    """:func:`locate` for the names one ledger records, relative to its directory, each built once.

    Note: the readers of a whole ledger (verify, lineage, the report) ask for a checkpoint's location from
    several places per row; building one is a few microseconds, a tenth of the report's collection at 100k rows.
    A location holds no listing (a snapshot is a new one), so the same one serves every caller.
    """

    def __init__(self, *, storage_options: Mapping[str, Any], relative_to: Path) -> None:
        self._options, self._base = storage_options, relative_to
        self._built: dict[str, Location] = {}

    def __call__(self, name: str) -> Location:
        found = self._built.get(name)
        if found is None:
            found = self._built[name] = locate(name, storage_options=self._options, relative_to=self._base)
        return found


def store_for(where: Location | str | os.PathLike[str]) -> CheckpointStore:
    """The store that answers for ``where`` (a location, or the text of one: no client is made for text)."""
    return OBJECTS if is_url(where) else LOCAL


def locate(
    where: Location | str | os.PathLike[str],
    *,
    storage_options: Mapping[str, Any] | None = None,
    relative_to: Path | None = None,
) -> Location:
    """``where`` as a location: a ``Path``, or a location in an object store (``proto://bucket/prefix``).

    ``storage_options`` go to the fsspec file system of a URL (ignored for a local path); a relative local path
    is taken relative to ``relative_to`` when given (as the ledger names its checkpoints).

    Raises:
        ConfigurationError: a URL naming no bucket, an unknown protocol, or a missing client library.
    """
    location = as_location(where, storage_options=storage_options)
    if relative_to is not None and isinstance(location, Path):
        return relative_to / location
    return location


def local_path(where: Location | str | os.PathLike[str]) -> Path | None:
    """The path of this machine's file system ``where`` names; None when it names a location in an object store
    (for what must be a local file: a ledger, an export, a run directory)."""
    if is_url(where):
        return None
    return Path(os.fspath(cast("str | os.PathLike[str]", where)))  # not a URL, so not an ObjectPath


def describe(location: Location) -> str:
    """``location`` for a message (see :meth:`.CheckpointStore.describe`)."""
    return store_for(location).describe(location)


def ledger_name(location: Location, *, relative_to: Path) -> str:
    """How the ledger at ``relative_to`` names ``location`` (see :meth:`.CheckpointStore.ledger_name`)."""
    return store_for(location).ledger_name(location, relative_to=relative_to)


def sorted_locations(locations: Iterable[Location]) -> list[Location]:
    """Local paths first, then object-store locations, each group in its own order."""
    items = list(locations)
    paths = sorted(p for p in items if isinstance(p, Path))
    objects = sorted(p for p in items if isinstance(p, ObjectPath))
    return [*paths, *objects]


def check_reachable(locations: Iterable[Location]) -> None:
    """Check that each bucket among ``locations`` can be reached and listed (one request per bucket).

    Raises:
        StorageAccessError: naming the endpoint and bucket, and how to fix it.
    """
    buckets = {(p.protocol, p.bucket): p for p in locations if isinstance(p, ObjectPath)}
    for location in buckets.values():
        OBJECTS.check_access(location)
