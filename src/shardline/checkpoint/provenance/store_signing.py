"""Deprecated: :mod:`.signing` signs and checks a checkpoint in an object store as on disk.

``sign_checkpoint``, ``check_signature`` and ``store_signature_path`` are the earlier names of
:func:`.signing.sign`, :func:`.signing.verify_signature` and :func:`.signing.default_signature_path`,
which take a local path or a URL alike (the store copies a bucket's objects down for the signing
library; see :func:`.signing.sign`). Each still resolves here, with a DeprecationWarning, until
:data:`shardline._deprecation.REMOVED_IN`.
"""

from __future__ import annotations

import warnings

from shardline._deprecation import REMOVED_IN
from shardline.checkpoint.provenance import signing

__all__: list[str] = []

_MOVED = {
    "sign_checkpoint": "sign_checkpoint",
    "check_signature": "check_signature",
    "store_signature_path": "default_signature_path",
}


def __getattr__(name: str) -> object:
    new = _MOVED.get(name)
    if new is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        f"{__name__}.{name} moved to {signing.__name__}.{new}, which signs and checks a checkpoint on disk or in "
        f"an object store alike; import it from there ({__name__} goes in {REMOVED_IN})",
        DeprecationWarning,
        stacklevel=2,
    )
    value: object = getattr(signing, new)
    return value
