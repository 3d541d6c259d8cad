"""Deprecated: :mod:`.signing` signs and checks a checkpoint in an object store as on disk.

``sign_checkpoint``, ``check_signature`` and ``store_signature_path`` are the earlier names of
:func:`.signing.sign`, :func:`.signing.verify_signature` and :func:`.signing.default_signature_path`,
which take a local path or a URL alike (the store copies a bucket's objects down for the signing
library; see :func:`.signing.sign`).
"""

from __future__ import annotations

from shardline.checkpoint.provenance.signing import check_signature, sign_checkpoint
from shardline.checkpoint.provenance.signing import default_signature_path as store_signature_path

__all__ = ["check_signature", "sign_checkpoint", "store_signature_path"]
