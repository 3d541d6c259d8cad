"""Credentials kept out of what a run records: ``config.yaml``, checkpoint manifests, trackers.

``checkpoint.storage_options`` may carry an object store's credentials (``key``, ``secret``,
``token``, ``client_kwargs.aws_secret_access_key``, an Azure ``account_key`` or
``connection_string``...). The run uses them as given; every copy of the config it writes --
the run directory's ``config.yaml``, the config inside each checkpoint's manifest (which
reviewers are handed), the tracker's parameters and config text -- carries
:data:`REDACTED` in their place. Everything else (``endpoint_url``, ``region_name``) is kept,
so ``shardline lineage`` and ``report`` still reach the bucket, with credentials from the
standard environment (``AWS_ACCESS_KEY_ID``...) or ``--storage-option``.

Note: names are matched, not values: a key is secret when its lower-cased name is one of the
credential names fsspec's object-store clients take, or contains ``secret``, ``password``,
``token``, ``credential`` or ends in ``_key``. A false positive costs one option the user
passes again; a false negative would write a credential to disk.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["REDACTED", "is_secret_name", "redact_config", "redact_options", "without_redacted"]

REDACTED = "<redacted>"
_NAMES = frozenset({"key", "secret", "token", "sas_token", "connection_string", "anon_key", "passwd"})
_PARTS = ("secret", "password", "token", "credential")


def is_secret_name(name: object) -> bool:
    """Whether an option named ``name`` holds a credential (see the module note)."""
    text = str(name).lower()
    return text in _NAMES or text.endswith("_key") or any(part in text for part in _PARTS)


def _holds_secret(name: object, value: object) -> bool:
    return is_secret_name(name) and value not in (None, "") and not isinstance(value, bool)


def redact_options(options: Any) -> Any:
    """``options`` with every credential's value replaced by :data:`REDACTED`, at any depth."""
    if isinstance(options, Mapping):
        return {
            k: (REDACTED if is_secret_name(k) and v not in (None, "") else redact_options(v))
            for k, v in options.items()
        }
    if isinstance(options, (list, tuple)):
        return [redact_options(v) for v in options]
    return options


def without_redacted(options: Mapping[str, Any]) -> dict[str, Any]:
    """Recorded options with the redacted entries left out, at any depth (to reach a run's bucket again)."""
    return {k: (without_redacted(v) if isinstance(v, Mapping) else v) for k, v in options.items() if v != REDACTED}


def redact_config(plain: dict[str, Any]) -> dict[str, Any]:
    """A plain config dict with ``checkpoint.storage_options`` redacted (the rest is returned as is)."""
    section = plain.get("checkpoint")
    if not isinstance(section, Mapping) or not section.get("storage_options"):
        return plain
    return {**plain, "checkpoint": {**section, "storage_options": redact_options(section["storage_options"])}}
