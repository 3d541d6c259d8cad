"""Sign a checkpoint (or an export) in the OpenSSF model-signing format, offline, with a private key; verify it.

The signature is what the reference tool writes and reads -- a Sigstore bundle holding a DSSE
envelope over an in-toto statement that lists every file of the directory with its SHA-256 --
so a reviewer checks it without shardline::

    pip install model-signing pyOpenSSL   # model-signing 1.1 needs pyOpenSSL but does not declare it
    model_signing verify key --signature step-100.sig --public_key pub.pem step-100

shardline uses the ``model_signing`` library (the optional ``[signing]`` extra) for the
cryptography and the hashing, and adds what it knows about the directory:

* **It never signs what does not verify.** A checkpoint is checked against its manifest (every
  byte), an export against its ``consolidation.json``, before the key is touched.
* **The signature pins the manifest hash.** ``manifest.json`` is one of the signed files, so its
  signed digest *is* the manifest hash; :func:`verify_signature` reports it, and the ledger's
  record of that hash ties the signature to the run.
* The signature goes **beside** the directory (``step-100.sig``), never inside it: a file inside
  would change what is signed.

Keys: elliptic-curve keys in PEM (P-256, P-384 or P-521; the format's key signer supports these),
e.g. ``openssl ecparam -name prime256v1 -genkey -noout -out key.pem`` and
``openssl ec -in key.pem -pubout -out pub.pem``. No network is used: there is no transparency
log and no certificate authority in this mode, only the key pair.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from shardline.checkpoint.integrity.export_verify import is_export, verify_export
from shardline.checkpoint.integrity.hashing import sha256_file
from shardline.checkpoint.integrity.manifest import MANIFEST
from shardline.checkpoint.integrity.verify import VerifyLevel, VerifyReport, verify_checkpoint
from shardline.checkpoint.storage.protocol import Location
from shardline.checkpoint.storage.stores import describe, locate, store_for
from shardline.errors import SignatureError

__all__ = [
    "INSTALL_HINT",
    "SignatureResult",
    "check_private_key",
    "check_signature",
    "default_signature_path",
    "sign",
    "sign_checkpoint",
    "signed_files",
    "verify_signature",
]

INSTALL_HINT = "pip install 'shardline[signing]'"
_KEY_HINT = (
    "make an elliptic-curve key pair with `openssl ecparam -name prime256v1 -genkey -noout -out key.pem` and "
    "`openssl ec -in key.pem -pubout -out pub.pem`"
)
_CURVES = ("secp256r1", "secp384r1", "secp521r1")


@dataclass(frozen=True)
class SignatureResult:
    """A signature made or checked: what it covers and the checkpoint fingerprint it pins."""

    path: str
    signature: str
    kind: str
    """``checkpoint``, ``export`` or ``file``."""
    files: tuple[str, ...]
    """The signed files, relative to ``path`` (the file's own name for a single file)."""
    manifest_sha256: str | None
    """The checkpoint's manifest hash (for an export: its source checkpoint's), as signed."""

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "signature": self.signature,
            "kind": self.kind,
            "files": list(self.files),
            "manifest_sha256": self.manifest_sha256,
        }


def default_signature_path(path: str | os.PathLike[str] | Location) -> Location:
    """``CKPT.sig`` beside the checkpoint directory (or ``FILE.sig`` beside a single file); beside the prefix, in
    its bucket, for a checkpoint in an object store."""
    location = locate(path).absolute()
    return location.with_name(location.name + ".sig")


def _model_signing() -> Any:
    try:
        import model_signing  # the optional [signing] extra
    except ImportError as e:
        raise SignatureError(
            f"signing and verifying signatures needs the OpenSSF model-signing library ({e}); install the optional "
            f"extra: {INSTALL_HINT}"
        ) from None
    return model_signing


def _kind(path: Path) -> str:
    if path.is_file():
        return "file"
    if not path.is_dir():
        raise SignatureError(f"{path} does not exist: pass a checkpoint directory, an export directory or a file")
    if (path / MANIFEST).is_file():
        return "checkpoint"
    if is_export(path):
        return "export"
    raise SignatureError(
        f"{path} is neither a shardline checkpoint (no {MANIFEST}) nor an export of one (no consolidation.json); "
        "shardline signs only what it can verify first"
    )


def _content_report(path: Path, kind: str, expected: str | None) -> VerifyReport | None:
    if kind == "checkpoint":
        return verify_checkpoint(path, level=VerifyLevel.FULL, expected_manifest_hash=expected)
    if kind == "export":
        return verify_export(path)
    return None


def _report_problem(report: VerifyReport) -> str:
    first = report.error or "; ".join(f"{p.path}: {p.kind} ({p.detail})" for p in report.problems[:3])
    return f"{report.path} does not verify -- {first}"


def _check_signature_place(location: Location, signature: Location) -> None:
    inside = str(signature.absolute()).startswith(str(location.absolute()).rstrip("/") + "/")
    if inside:
        raise SignatureError(
            f"the signature {signature} would be inside {location}, which would change what is signed; put it beside "
            f"the directory (the default is {default_signature_path(location)})"
        )


def check_private_key(key: Path, password: str | None) -> None:
    """Read the key with ``cryptography`` first, to name what is wrong with it before signing.

    Raises:
        SignatureError: the key cannot be read, is encrypted without a password (or the reverse), or is
            not an elliptic-curve key on P-256, P-384 or P-521; the message says how to make one.
    """
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    try:
        data = key.read_bytes()
    except OSError as e:
        raise SignatureError(f"cannot read the private key {key}: {e.strerror or e}") from None
    try:
        loaded = serialization.load_pem_private_key(data, password.encode() if password is not None else None)
    except TypeError:
        raise SignatureError(
            f"the private key {key} is encrypted: pass its password through an environment variable "
            "(--password-env NAME)"
            if password is None
            else f"the private key {key} is not encrypted, but a password was given; drop --password-env"
        ) from None
    except ValueError as e:
        raise SignatureError(
            f"cannot load the private key {key} ({e}); it must be a PEM private key (and its password right). "
            f"To {_KEY_HINT}"
        ) from None
    if not isinstance(loaded, ec.EllipticCurvePrivateKey) or loaded.curve.name not in _CURVES:
        what = loaded.curve.name if isinstance(loaded, ec.EllipticCurvePrivateKey) else type(loaded).__name__
        raise SignatureError(
            f"the private key {key} is a {what} key; the model-signing key format takes elliptic-curve keys on "
            f"P-256, P-384 or P-521. To {_KEY_HINT}"
        )


def signed_files(signature: str | os.PathLike[str]) -> dict[str, str]:
    """``file -> sha256`` as listed in a model-signing signature's payload (read only, not verified).

    Raises:
        SignatureError: the file is not a model-signing signature bundle.
    """
    sig = Path(signature)
    try:
        bundle = json.loads(sig.read_text(encoding="utf-8"))
        statement = json.loads(base64.b64decode(bundle["dsseEnvelope"]["payload"]))
        return {str(r["name"]): str(r["digest"]) for r in statement["predicate"]["resources"]}
    except FileNotFoundError:
        raise SignatureError(f"no signature at {sig}; sign with `shardline sign` or pass --signature PATH") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SignatureError(f"{sig} is not a model-signing signature bundle ({type(e).__name__}: {e})") from None


def _result(path: Path, signature: Path, kind: str) -> SignatureResult:
    files = signed_files(signature)
    pinned: str | None = None
    if kind == "checkpoint":
        pinned = files.get(MANIFEST)
    elif kind == "export":
        try:
            pinned = (json.loads((path / "consolidation.json").read_text()).get("source") or {}).get("manifest_sha256")
        except (OSError, ValueError):
            pinned = None
    return SignatureResult(
        path=str(path), signature=str(signature), kind=kind, files=tuple(sorted(files)), manifest_sha256=pinned
    )


def sign(
    path: str | os.PathLike[str] | Location,
    *,
    private_key: str | os.PathLike[str],
    signature: str | os.PathLike[str] | Location | None = None,
    password: str | None = None,
    expected_manifest_hash: str | None = None,
    overwrite: bool = False,
    storage_options: Mapping[str, Any] | None = None,
) -> SignatureResult:
    """Sign the checkpoint, export directory or file at ``path`` with an elliptic-curve private key (offline).

    ``path`` may be an object-store URL (``s3://bucket/prefix/step-N``); ``storage_options`` then go to
    its fsspec file system (default: the standard AWS environment). The content is verified first (a
    checkpoint against its manifest -- and against ``expected_manifest_hash`` when given -- an export
    against ``consolidation.json``). The signature is written whole to ``signature`` (default
    :func:`default_signature_path`: beside the directory, or beside the prefix in its bucket).

    Note: a checkpoint in a bucket is signed from a copy. The OpenSSF model-signing library hashes
    the files of a local directory; it has no reader for an object store. So the store copies every
    object under the prefix into a private temporary directory of the same name
    (:meth:`.CheckpointStore.local_copy`; a local checkpoint is used where it is), the copy is
    verified before the key is touched -- the same refusal as on disk --, signed, and the signature
    stored where ``shardline verify`` and ``shardline report`` look for it. The copy needs free
    space for one checkpoint in ``TMPDIR``, and is removed afterwards.

    Raises:
        SignatureError: the extra is missing, the key is unusable, the content does not verify,
            the signature would land inside the directory, or it exists and ``overwrite`` is False.
        StorageAccessError: the bucket cannot be reached, listed or written.
    """
    location = locate(path, storage_options=storage_options)
    store = store_for(location)
    store.check_access(location)
    target = (
        locate(signature, storage_options=storage_options)
        if signature is not None
        else default_signature_path(location)
    )
    _check_signature_place(location, target)
    if target.exists() and not overwrite:
        raise SignatureError(
            f"{target} already exists; pass --force to replace it (or choose another --signature path)"
        )
    key = Path(private_key)
    check_private_key(key, password)  # before a checkpoint is copied down for nothing
    with store.local_copy(location) as root, _named(root, location):
        kind = _kind(root)
        report = _content_report(root, kind, expected_manifest_hash)
        if report is not None and not report.ok:
            raise SignatureError(f"refusing to sign: {_report_problem(report)}. Run `shardline verify {root}`.")
        ms = _model_signing()
        with tempfile.TemporaryDirectory(prefix="shardline-sign-") as tmp:
            made = Path(tmp) / target.name
            try:
                config = ms.signing.Config().use_elliptic_key_signer(
                    private_key=key,
                    password=password.encode() if password is not None else None,  # cryptography takes bytes
                )
                config.sign(root, made)
            except Exception as e:
                raise SignatureError(f"signing {root} failed: {type(e).__name__}: {e}") from None
            result = _result(root, made, kind)
            data = made.read_bytes()
    store_for(target).put(target, data)
    return replace(result, path=str(location), signature=str(target))


def verify_signature(
    path: str | os.PathLike[str] | Location,
    *,
    public_key: str | os.PathLike[str],
    signature: str | os.PathLike[str] | Location | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> SignatureResult:
    """Check a model-signing signature of ``path`` with ``public_key``: the same check as
    ``model_signing verify key``, done by that library (every file re-hashed and compared).

    ``path`` and ``signature`` may be object-store URLs (``storage_options`` go to their file
    system): the objects and the signature are copied down and the library verifies the copy (see
    :func:`sign`), so an object altered, missing or added in the bucket fails as it would on disk.

    Raises:
        SignatureError: the extra is missing, or the signature does not verify (the message says why:
            another key, an altered, missing or extra file).
        StorageAccessError: the bucket cannot be reached, listed or read.
    """
    location = locate(path, storage_options=storage_options)
    store = store_for(location)
    store.check_access(location)
    where = (
        locate(signature, storage_options=storage_options)
        if signature is not None
        else default_signature_path(location)
    )
    if not where.is_file():
        raise SignatureError(f"no signature at {describe(where)}; sign with `shardline sign` or pass --signature PATH")
    with (
        store_for(where).local_copy(where) as sig,
        _named(sig, where),
        store.local_copy(location) as root,
        _named(root, location),
    ):
        kind = _kind(root)
        signed_files(sig)  # a clear error for a malformed signature file
        pub = Path(public_key)
        if not pub.is_file():
            raise SignatureError(f"no public key at {pub}")
        ms = _model_signing()
        noise = io.StringIO()
        try:
            with contextlib.redirect_stdout(noise):
                ms.verifying.Config().use_elliptic_key_verifier(public_key=pub).verify(root, sig)
        except Exception as e:
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            if type(e).__name__ == "InvalidSignature":
                reason = "the signature was not made with the private key of this public key"
            elif reason.startswith("Signature mismatch"):
                reason = "the files differ from the signed ones -- " + "; ".join(_differences(root, sig))
            raise SignatureError(f"signature {sig} does not verify for {root}: {reason}") from None
        result = _result(root, sig, kind)
    return replace(result, path=str(location), signature=str(where))


sign_checkpoint = sign
"""Deprecated name of :func:`sign` (which takes a URL too)."""
check_signature = verify_signature
"""Deprecated name of :func:`verify_signature` (which takes a URL too)."""


@contextlib.contextmanager
def _named(copy: Path, location: Location) -> Iterator[None]:
    """Errors raised inside name ``location`` where they name its local ``copy``."""
    try:
        yield
    except SignatureError as e:
        if str(copy) == str(location):
            raise
        raise SignatureError(str(e).replace(str(copy), str(location))) from None


def _differences(root: Path, sig: Path) -> list[str]:
    """Which files differ from the signed list (to name them; the verdict is the library's)."""
    signed = signed_files(sig)
    if root.is_file():
        on_disk = {root.name: sha256_file(root)[1]}
    else:
        on_disk = {
            str(p.relative_to(root)): sha256_file(p)[1]
            for p in sorted(root.rglob("*"))
            if p.is_file() and not p.relative_to(root).parts[0].startswith(".git")
        }
    out = [f"{name}: altered (sha256 {on_disk[name][:16]}..., signed {signed[name][:16]}...)"
           for name in sorted(set(signed) & set(on_disk)) if signed[name] != on_disk[name]]  # fmt: skip
    out += [f"{name}: missing" for name in sorted(set(signed) - set(on_disk))]
    out += [f"{name}: not signed (an extra file)" for name in sorted(set(on_disk) - set(signed))]
    return out or ["the library reported a mismatch"]
