"""``shardline sign``: argument parsing for :func:`shardline.checkpoint.provenance.signing.sign` (verification is
``shardline verify CKPT --public-key PUB.pem``, in :mod:`.checkpoint`)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from shardline.checkpoint.storage.stores import store_for
from shardline.cli.common import add_storage_options, sha256_arg, storage_options
from shardline.errors import ShardlineError, StorageAccessError

__all__ = ["register"]


def _password(args: argparse.Namespace) -> str | None:
    if args.password_env is None:
        return None
    value = os.environ.get(args.password_env)
    if value is None:
        raise ShardlineError(f"--password-env {args.password_env}: no such environment variable is set")
    return value


def _cmd_sign(args: argparse.Namespace) -> int:
    from shardline.checkpoint.provenance.signing import sign

    try:
        result = sign(
            args.path,
            private_key=args.private_key,
            signature=args.signature,
            password=_password(args),
            expected_manifest_hash=args.expect,
            overwrite=args.force,
            storage_options=storage_options(args),
        )
    except (ShardlineError, OSError) as e:
        message = str(e) if isinstance(e, ShardlineError) else f"{type(e).__name__}: {e}"
        if args.json:
            print(json.dumps({"ok": False, "error": message, "error_type": type(e).__name__}, indent=2))
        else:
            print(f"error: {message}", file=sys.stderr)
        return 2 if isinstance(e, StorageAccessError) else 1
    if args.json:
        print(json.dumps({"ok": True, **result.to_json()}, indent=2, sort_keys=True))
        return 0
    pinned = f"; it pins manifest hash {result.manifest_sha256}" if result.manifest_sha256 else ""
    print(f"Signed {result.path} ({len(result.files)} files, verified first) -> {result.signature}{pinned}.")
    name = result.path.rstrip("/").rsplit("/", 1)[-1]
    copy = store_for(result.path).copy_command(result.path, name, recursive=True)
    if copy is not None:  # in an object store: the standard tools check a copy
        copy_sig = store_for(result.signature).copy_command(result.signature, f"{name}.sig", recursive=False)
        print(
            f"Check it with `shardline verify {result.path} --public-key PUB.pem`, or without shardline (pip install "
            f"model-signing pyOpenSSL) on a copy:\n  {copy} && {copy_sig or f'cp {result.signature} {name}.sig'}\n"
            f"  model_signing verify key --signature {name}.sig --public_key PUB.pem {name}"
        )
        return 0
    print(
        "Anyone can check it without shardline (pip install model-signing pyOpenSSL):\n"
        f"  model_signing verify key --signature {result.signature} --public_key PUB.pem {result.path}"
    )
    return 0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``sign`` to the ``shardline`` command."""
    sign = subparsers.add_parser(
        "sign",
        help="sign a checkpoint or export (OpenSSF model-signing format, offline, private key); needs [signing]",
    )
    sign.add_argument(
        "path",
        help="checkpoint directory, export directory (consolidate OUT/), a single file, or a checkpoint in an "
        "object store (s3://BUCKET/PREFIX/step-N: copied down, verified, signed; the signature uploaded beside it)",
    )
    sign.add_argument("--private-key", required=True, metavar="KEY.pem", help="elliptic-curve private key (PEM)")
    sign.add_argument(
        "--signature",
        metavar="PATH",
        help="where to write the signature, a path or a URL (default: PATH.sig beside the directory or prefix)",
    )
    sign.add_argument(
        "--password-env", metavar="NAME", help="environment variable holding the private key's password, if any"
    )
    sign.add_argument(
        "--expect", metavar="SHA256", type=sha256_arg, help="require this manifest hash (e.g. from the ledger)"
    )
    sign.add_argument("--force", action="store_true", help="replace an existing signature file")
    sign.add_argument("--json", action="store_true", help="machine-readable output")
    add_storage_options(sign)
    sign.set_defaults(func=_cmd_sign)
