"""Run tags: the labels a team files runs under (project, ticket, dataset licence, owner).

One set of ``{key: value}`` strings, given as ``tracking.tags`` to ``shardline train`` (YAML or
``tracking.tags.ticket=ABC-1`` on the command line) or as ``tags=`` to
:class:`~shardline.checkpoint.CheckpointManager`. Every checkpoint saved with them records them
in its manifest (``run_tags``) and its provenance statement (``predicate.run_tags``), and the
trackers attach them to the run, so a checkpoint of ticket X can be found from either side.

Note: why the rules are narrow. A tag must survive every place it goes unchanged: MLflow tag
keys allow letters, digits, ``_ - . / `` and space (250 characters); W&B run tags hold 64
characters; a manifest is canonical JSON. So keys are short identifiers (no space, which a
filter string would need quoting for), values are printable single-line text, and names in
``shardline.`` and ``mlflow.`` are left to the tools that own them. A bad tag is refused when
the config or the manager is built, before any training is spent.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from shardline.errors import ConfigurationError

__all__ = ["MAX_KEY", "MAX_TAGS", "MAX_VALUE", "RUN_TAGS_KEY", "check_run_tags"]

RUN_TAGS_KEY = "run_tags"
"""The manifest key (and provenance-statement predicate key) holding a checkpoint's run tags."""
MAX_TAGS = 64
MAX_KEY = 64
MAX_VALUE = 256
_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-/]*$")
_RESERVED = ("shardline.", "mlflow.")


def check_run_tags(tags: Mapping[str, Any] | None, *, where: str = "tags") -> dict[str, str]:
    """``tags`` checked and copied as ``{key: value}`` sorted by key (empty for None).

    Args:
        tags: The run tags; keys and values must be strings.
        where: How the user spelled the setting (``tracking.tags``, ``tags``), for the error message.

    Raises:
        ConfigurationError: not a mapping, too many tags, a key or value that is not a string, empty, too long,
            has characters outside the allowed set, or a reserved key (each message names the tag and the rule).
    """
    if tags is None:
        return {}
    if not isinstance(tags, Mapping):
        raise ConfigurationError(f"{where} must be a mapping of KEY: VALUE strings, got {type(tags).__name__}")
    if len(tags) > MAX_TAGS:
        raise ConfigurationError(f"{where} has {len(tags)} tags; at most {MAX_TAGS} are allowed")
    out: dict[str, str] = {}
    for key, value in tags.items():
        if not isinstance(key, str) or not _KEY.match(key) or len(key) > MAX_KEY:
            raise ConfigurationError(
                f"{where}: key {key!r} is not a tag name: use 1-{MAX_KEY} letters, digits, '_', '-', '.' or '/', "
                "starting with a letter or digit (e.g. ticket, dataset_licence)"
            )
        if key.lower().startswith(_RESERVED):
            raise ConfigurationError(
                f"{where}: key {key!r} is reserved (names starting with {' or '.join(_RESERVED)} belong to the tools "
                "that set them); choose another name"
            )
        if not isinstance(value, str):
            raise ConfigurationError(
                f"{where}.{key}={value!r} is not a string ({type(value).__name__}); tag values are strings (quote it: "
                f"{where}.{key}='\"{value}\"' on the command line)"
            )
        if not value or len(value) > MAX_VALUE or not value.isprintable():
            raise ConfigurationError(
                f"{where}.{key}={value[:40]!r}{'...' if len(value) > 40 else ''}: a tag value is 1-{MAX_VALUE} "
                f"printable characters on one line (got {len(value)} characters)"
            )
        out[key] = value
    return dict(sorted(out.items()))
