"""What several adapters share: JSON output, one-line errors, argument types."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from shardline.errors import ConfigurationError, ShardlineError, StorageAccessError

__all__ = ["emit_json", "fail", "sha256_arg"]


def emit_json(obj: Any) -> None:
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


def sha256_arg(text: str) -> str:
    """argparse type of ``--expect``: a SHA-256 in hex, or a usage error naming the argument."""
    from shardline.checkpoint.integrity.verify import check_expected_hash

    try:
        return str(check_expected_hash(text, where="--expect"))
    except ConfigurationError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
