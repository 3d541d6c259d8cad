"""What several adapters share: JSON output, one-line errors, argument types."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from shardline.errors import ConfigurationError, ShardlineError, StorageAccessError

__all__ = ["add_storage_options", "emit_json", "fail", "row_count", "sha256_arg", "storage_options"]


def emit_json(obj: object) -> None:
    """Print ``obj`` as one indented JSON object with sorted keys (``--json`` output)."""
    print(json.dumps(obj, indent=2, sort_keys=True))


def fail(args: argparse.Namespace, error: Exception) -> int:
    """Report ``error`` in one line (stderr; a JSON object on stdout with ``--json``); returns exit code 1.

    An object-store location that cannot be used (no such bucket, refused credentials, a URL without
    a bucket: :class:`~shardline.errors.StorageAccessError`) is a usage error: exit code 2.
    """
    message = str(error) if isinstance(error, ShardlineError) else _os_error(error)
    if getattr(args, "json", False):
        emit_json({"ok": False, "error": message, "error_type": type(error).__name__})
    else:
        print(f"error: {message}", file=sys.stderr)
    return 2 if isinstance(error, StorageAccessError) else 1


def _os_error(error: Exception) -> str:
    if isinstance(error, OSError) and error.filename is not None:
        return f"{error.filename}: {error.strerror or error}"
    return f"{type(error).__name__}: {error}"


def add_storage_options(parser: argparse.ArgumentParser) -> None:
    """Add ``--storage-option KEY=VALUE`` (repeatable): options of the object store's fsspec file system."""
    parser.add_argument(
        "--storage-option",
        dest="storage_option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        type=_storage_option,
        help="an option of the object store's client, repeatable: endpoint_url=URL, key=ID, secret=SECRET, "
        "client_kwargs.region_name=R, use_ssl=false (true/false are booleans); default: the AWS environment"
        " (and, for a run directory, the checkpoint.storage_options its config.yaml records)",
    )


def storage_options(args: argparse.Namespace) -> dict[str, Any] | None:
    """The ``--storage-option`` pairs as one nested dict (dotted keys nest); None when none was given."""
    pairs = getattr(args, "storage_option", None) or []
    if not pairs:
        return None
    options: dict[str, Any] = {}
    for key, value in pairs:
        *parents, leaf = key.split(".")
        node = options
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigurationError(f"--storage-option {key}: {part} was already given a value; give it once")
            node = child
        node[leaf] = value
    return options


def _storage_option(text: str) -> tuple[str, str | bool]:
    """argparse type of ``--storage-option``: ``KEY=VALUE``; ``true``/``false`` become booleans, the rest stays text.

    Note: text, not YAML. A secret such as ``12345`` or ``0x1f`` must reach the client exactly as typed.
    """
    key, sep, value = text.partition("=")
    if not sep or not key.strip() or any(not part for part in key.strip().split(".")):
        raise argparse.ArgumentTypeError(
            f"--storage-option {text!r}: expected KEY=VALUE (e.g. endpoint_url=http://127.0.0.1:8333)"
        )
    flags = {"true": True, "false": False}
    return key.strip(), flags.get(value.lower(), value)


def sha256_arg(text: str) -> str:
    """argparse type of ``--expect``: a SHA-256 in hex, or a usage error naming the argument."""
    from shardline.checkpoint.integrity.verify import check_expected_hash

    try:
        return str(check_expected_hash(text, where="--expect"))
    except ConfigurationError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def row_count(text: str) -> int:
    """A positive whole number (``--limit``, ``--since``), or a message saying what was given."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}")
    return value
