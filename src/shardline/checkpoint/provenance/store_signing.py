"""Signing a checkpoint kept in an object store (``s3://BUCKET/PREFIX/step-N``), and checking its signature.

:func:`sign_checkpoint` and :func:`check_signature` take a local path or a URL. A local path goes
straight to :func:`~shardline.checkpoint.provenance.signing.sign` /
:func:`~shardline.checkpoint.provenance.signing.verify_signature`; a URL is signed exactly as a
directory would be, and its signature lands where ``shardline verify`` and ``shardline report``
look for it: ``step-N.sig`` beside the prefix, in the bucket.

Note: why a copy. The OpenSSF model-signing library hashes the files of a local directory (its
format lists every file with its SHA-256); it has no reader for an object store. So every object
under the prefix is copied into a private temporary directory of the same name, the copy is
checked against the manifest (every byte, and against the manifest hash the caller expects,
e.g. the ledger's) before the key is touched -- the same refusal as on disk --, signed, and
the signature uploaded (one PUT: an object appears whole or not at all). Checking a signature
copies the objects and the signature the same way and lets the library verify the copy, so an
object altered, missing or added in the bucket fails as it would on disk. The copy needs free
space for one checkpoint in the temporary directory (``TMPDIR``), and is removed afterwards.
"""

from __future__ import annotations

import os
import posixpath
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

from shardline.checkpoint.provenance.signing import SignatureResult, check_private_key, sign, verify_signature
from shardline.checkpoint.storage.objects import ObjectPath, as_location, check_access, is_url
from shardline.errors import SignatureError

__all__ = ["check_signature", "sign_checkpoint", "store_signature_path"]


def store_signature_path(checkpoint: ObjectPath) -> ObjectPath:
    """``step-N.sig`` beside the prefix ``step-N`` in its bucket (where ``shardline sign`` puts it)."""
    return checkpoint.with_name(checkpoint.name + ".sig")


def _copy_down(prefix: ObjectPath, into: Path) -> Path:
    """Every object under ``prefix`` into ``into/<prefix name>/`` (sub-prefixes kept); the local directory."""
    target = into / prefix.name
    keys = [str(k) for k in prefix.fs.find(prefix.key)]
    if not keys:
        raise SignatureError(
            f"{prefix} holds no objects (endpoint {prefix.endpoint}): pass a checkpoint prefix such as {prefix}/step-N"
        )
    for key in keys:
        relative = posixpath.relpath(key, prefix.key)
        local = target.joinpath(*relative.split("/"))
        local.parent.mkdir(parents=True, exist_ok=True)
        prefix.fs.get_file(key, str(local))
    return target


def _fetch(signature: Any, into: Path, storage_options: Mapping[str, Any] | None) -> Path:
    """A signature named by URL copied into ``into`` (a local path is used where it is)."""
    location = as_location(signature, storage_options=storage_options)
    if not isinstance(location, ObjectPath):
        return Path(location)
    if not location.is_file():
        raise SignatureError(
            f"no signature at {location} (endpoint {location.endpoint}); sign with `shardline sign` or pass "
            "--signature PATH"
        )
    local = into / location.name
    local.write_bytes(location.read_bytes())
    return local


def sign_checkpoint(
    path: str | os.PathLike | ObjectPath,
    *,
    private_key: str | os.PathLike,
    signature: str | os.PathLike | ObjectPath | None = None,
    password: str | None = None,
    expected_manifest_hash: str | None = None,
    overwrite: bool = False,
    storage_options: Mapping[str, Any] | None = None,
) -> SignatureResult:
    """Sign the checkpoint (or export, or file) at ``path``, a local path or an object-store URL.

    For a URL, the signature goes to ``signature`` (a URL or a local path; default
    :func:`store_signature_path`), after the checkpoint's objects were copied down and verified
    (see the module note). The result names the URL and where the signature went.
    ``storage_options`` go to the fsspec file system of the URLs (default: the standard AWS environment).

    Raises:
        SignatureError: as :func:`~shardline.checkpoint.provenance.signing.sign` (the content does not
            verify, the key is unusable, the signature exists and ``overwrite`` is False, ...).
        StorageAccessError: the bucket cannot be reached, listed or written.
    """
    if not is_url(path):
        return sign(
            path,
            private_key=private_key,
            signature=None if signature is None else Path(str(signature)),
            password=password,
            expected_manifest_hash=expected_manifest_hash,
            overwrite=overwrite,
        )
    prefix = cast(ObjectPath, as_location(path, storage_options=storage_options))
    check_access(prefix)
    check_private_key(Path(private_key), password)  # before copying a checkpoint down for nothing
    target = (
        as_location(signature, storage_options=storage_options)
        if signature is not None
        else store_signature_path(prefix)
    )
    if isinstance(target, ObjectPath) and target.key.startswith(prefix.key + "/"):
        raise SignatureError(
            f"the signature {target} would be inside {prefix}, which would change what is signed; put it beside the "
            f"prefix (the default is {store_signature_path(prefix)})"
        )
    if target.exists() and not overwrite:
        raise SignatureError(f"{target} already exists; pass --force to replace it (or choose another --signature)")
    with tempfile.TemporaryDirectory(prefix="shardline-sign-") as tmp:
        local = _copy_down(prefix, Path(tmp))
        made = sign(
            local,
            private_key=private_key,
            password=password,
            expected_manifest_hash=expected_manifest_hash,
            overwrite=True,  # the copy's own .sig; whether the real one may be replaced was checked above
        )
        data = Path(made.signature).read_bytes()
    if isinstance(target, ObjectPath):
        target.write_bytes(data)
    else:
        Path(target).write_bytes(data)
    return SignatureResult(
        path=str(prefix), signature=str(target), kind=made.kind, files=made.files, manifest_sha256=made.manifest_sha256
    )


def check_signature(
    path: str | os.PathLike | ObjectPath,
    *,
    public_key: str | os.PathLike,
    signature: str | os.PathLike | ObjectPath | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> SignatureResult:
    """Check the model-signing signature of ``path`` (a local path or an object-store URL) with ``public_key``.

    For a URL, the signature defaults to :func:`store_signature_path` (a URL or a local path may be
    given); the objects are copied down and the library verifies the copy (see the module note).
    ``storage_options`` go to the fsspec file system of the URLs (default: the standard AWS environment).

    Raises:
        SignatureError: as :func:`~shardline.checkpoint.provenance.signing.verify_signature`, naming the URL.
        StorageAccessError: the bucket cannot be reached, listed or read.
    """
    if not is_url(path):
        return verify_signature(path, public_key=public_key, signature=None if signature is None else str(signature))
    prefix = cast(ObjectPath, as_location(path, storage_options=storage_options))
    check_access(prefix)
    where = signature if signature is not None else store_signature_path(prefix)
    with tempfile.TemporaryDirectory(prefix="shardline-verify-sig-") as tmp:
        sig = _fetch(where, Path(tmp), storage_options)
        local = _copy_down(prefix, Path(tmp) / "copy")
        try:
            checked = verify_signature(local, public_key=public_key, signature=sig)
        except SignatureError as e:
            raise SignatureError(str(e).replace(str(local), str(prefix)).replace(str(sig), str(where))) from None
    return SignatureResult(
        path=str(prefix),
        signature=str(where),
        kind=checked.kind,
        files=checked.files,
        manifest_sha256=checked.manifest_sha256,
    )
