"""Canonical JSON and the hashes built on it: the one place that defines how a manifest is hashed.

Note: the canonical form. A manifest is hashed as the UTF-8 bytes of
``json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)``:
keys sorted, no whitespace, non-ASCII characters written as themselves. Floats are
forbidden, because their text form differs between JSON libraries (``1e-05`` vs ``0.00001``),
which would make the hash unreproducible with other tools. ``manifest.json`` is written in
exactly this form, so ``sha256sum manifest.json`` *is* the manifest hash, and so is::

    python3 -c 'import hashlib,json,sys; m=json.load(open(sys.argv[1],encoding="utf-8")); \
print(hashlib.sha256(json.dumps(m,sort_keys=True,separators=(",",":"),ensure_ascii=False,\
allow_nan=False).encode("utf-8")).hexdigest())' manifest.json

which also proves the file is canonical. docs/verification.md shows this procedure and a test
runs it.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from collections.abc import Mapping
from typing import Any

from shardline.errors import ConfigurationError

__all__ = [
    "HASH_ALGORITHM",
    "canonical_json",
    "config_hash",
    "manifest_hash",
    "sha256_hex",
    "tag_floats",
]

HASH_ALGORITHM = "sha256"


def _check_no_floats(value: Any, where: str) -> None:
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return
    if isinstance(value, float):
        raise ConfigurationError(
            f"canonical JSON forbids floats, found {value!r} at {where or '<top>'}; store it as an integer "
            "(e.g. nanoseconds) or a string"
        )
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ConfigurationError(
                    f"canonical JSON needs string keys, found {key!r} ({type(key).__name__}) at {where or '<top>'}"
                )
            _check_no_floats(item, f"{where}.{key}" if where else key)
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_no_floats(item, f"{where}[{i}]")
        return
    raise ConfigurationError(
        f"canonical JSON holds only dicts, lists, strings, integers, booleans and null; found "
        f"{type(value).__name__} at {where or '<top>'}"
    )


_SCALARS = frozenset({str, int, bool, type(None)})
_KEYS = frozenset({str})


def _plain(value: Any) -> bool:
    """Whether ``value`` holds only dicts with string keys, lists, strings, integers, booleans and None (no floats).

    Note: exact types, looked at in C (``set(map(type, ...))``) a list or a dict at a time, and no path built on the
    way: the check of a manifest listing 131k files (16,384 ranks x 8) costs a few percent of its JSON encoding.
    Anything else -- a float, a subclass such as an ``IntEnum``, a tuple -- returns False, and
    :func:`_check_no_floats` then decides, with the path for its message.
    """
    kind = type(value)
    if kind in _SCALARS:
        return True
    if kind is dict:
        return set(map(type, value)) <= _KEYS and _plain_items(list(value.values()))
    if kind is list:
        return _plain_items(value)
    return False


def _plain_items(items: list[Any]) -> bool:
    """:func:`_plain` of every item of ``items``; a list of flat dicts (a manifest's files) in three C passes."""
    kinds = set(map(type, items))
    if kinds <= _SCALARS:
        return True
    if kinds == {dict}:
        keys = set(map(type, itertools.chain.from_iterable(items)))
        values = set(map(type, itertools.chain.from_iterable(map(dict.values, items))))
        if keys <= _KEYS and values <= _SCALARS:
            return True
    return all(map(_plain, items))


def canonical_json(obj: Any) -> bytes:
    """The canonical UTF-8 JSON bytes of ``obj`` (sorted keys, no whitespace, no floats).

    Raises:
        ConfigurationError: ``obj`` holds a float, a non-string key or a non-JSON type.
    """
    if not _plain(obj):
        _check_no_floats(obj, "")
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return text.encode("utf-8")


def sha256_hex(data: bytes) -> str:
    """Hex SHA-256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def manifest_hash(manifest: Mapping[str, Any]) -> str:
    """The manifest hash: hex SHA-256 of the canonical JSON of ``manifest`` (a pure function)."""
    return sha256_hex(canonical_json(manifest))


def _tag_floats(value: Any) -> Any:
    # Note: floats in a training config (learning rates...) are hashed through their shortest
    # round-trip text, tagged so that the string "0.1" and the float 0.1 hash differently.
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return {"$float": repr(value) if math.isfinite(value) else str(value)}
    if isinstance(value, Mapping):
        return {str(k): _tag_floats(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_tag_floats(v) for v in value]
    raise ConfigurationError(
        f"the training config must be plain JSON-able data (dicts, lists, strings, numbers, booleans, null); "
        f"found {type(value).__name__}: {value!r}. Resolve it first, e.g. OmegaConf.to_container(cfg, resolve=True)."
    )


def tag_floats(value: Any) -> Any:
    """``value`` with each float ``f`` written ``{"$float": repr(f)}``: the form :func:`config_hash` hashes."""
    return _tag_floats(value)


def config_hash(config: Mapping[str, Any]) -> str:
    """Hex SHA-256 of a training config: canonical JSON with each float ``f`` as ``{"$float": repr(f)}``."""
    return sha256_hex(canonical_json(_tag_floats(config)))
