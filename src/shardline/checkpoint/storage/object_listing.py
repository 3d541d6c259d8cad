"""Listings of an object-store prefix that look below its first level: every object (a checkpoint whose data files
are spread over ``shards/GGGG/``, :mod:`.key_prefixes`), and the empty folders a store with directories keeps."""

from __future__ import annotations

import posixpath
from typing import Any

__all__ = ["by_folder", "deep_listing", "empty_folders"]


def deep_listing(fs: Any, key: str) -> dict[str, tuple[str, int]]:
    """Every object under ``key`` by its path relative to it -> ``("file", size)``, and every folder on the way ->
    ``("directory", 0)``: one listing with no delimiter (as many LIST pages as there are thousands of objects)."""
    listing: dict[str, tuple[str, int]] = {}
    try:
        found = fs.find(key, detail=True, withdirs=False)
    except FileNotFoundError:
        found = {}
    for name, entry in found.items():
        relative = str(name).strip("/")[len(key) :].strip("/")
        if not relative or entry.get("type") == "directory":
            continue
        listing[relative] = ("file", int(entry.get("size") or 0))
        folder = posixpath.dirname(relative)
        while folder and folder not in listing:
            listing[folder] = ("directory", 0)
            folder = posixpath.dirname(folder)
    return listing


def empty_folders(fs: Any, key: str) -> list[str]:
    """The folders under ``key`` that a store with directories (SeaweedFS's filer) still lists once their objects
    are deleted, parents before their children (S3 proper lists none: one LIST)."""
    found: list[str] = []
    pending = [key]
    while pending:
        try:
            entries = fs.ls(pending.pop(), detail=True)
        except FileNotFoundError:
            continue
        for entry in entries:
            name = str(entry["name"]).strip("/")
            if entry.get("type") == "directory" and name.startswith(key + "/"):
                found.append(name)
                pending.append(name)
    return found


def by_folder(listing: dict[str, tuple[str, int]]) -> dict[str, dict[str, tuple[str, int]]]:
    """A :func:`deep_listing` split by first folder: ``{folder: {path inside it: entry}}``, in one pass."""
    folders: dict[str, dict[str, tuple[str, int]]] = {}
    for name, entry in listing.items():
        head, sep, rest = name.partition("/")
        if sep:
            folders.setdefault(head, {})[rest] = entry
    return folders
