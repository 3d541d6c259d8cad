"""Object-store URLs (``proto://bucket/key``) and the fsspec clients that serve them: one client per protocol,
options and AWS environment, and the endpoint a client talks to (for messages).
"""

from __future__ import annotations

import os
import posixpath
import threading
from collections.abc import Mapping
from typing import Any

from shardline.errors import ConfigurationError, StorageAccessError

__all__ = ["SCHEME_SEP", "endpoint_of", "filesystem", "split_url"]

SCHEME_SEP = "://"
# Protocols whose fsspec client ships in an extra of ours, and that extra's name.
_EXTRAS = {"s3": "s3", "s3a": "s3"}
_CACHE: dict[tuple[str, tuple[tuple[str, str], ...]], Any] = {}
_CACHE_LOCK = threading.Lock()


def split_url(url: str) -> tuple[str, str]:
    """``(protocol, "bucket/key")`` of ``proto://bucket/key`` (trailing slashes dropped).

    Raises:
        StorageAccessError: no bucket is named (``s3://`` alone, or ``s3:///x``).
    """
    scheme, _, rest = url.partition(SCHEME_SEP)
    key = posixpath.normpath(rest).strip("/") if rest.strip("/") else ""
    if not key or rest.startswith("/") or key.startswith(".."):
        raise StorageAccessError(
            f"{url!r} names no bucket: an object-store checkpoint location reads {scheme}://BUCKET/PREFIX "
            f"(e.g. {scheme}://my-bucket/run-1/checkpoints)"
        )
    return scheme.lower(), key


def filesystem(protocol: str, options: Mapping[str, Any]) -> Any:
    """The fsspec file system of ``protocol`` with ``options`` (one instance per distinct options)."""
    # The AWS environment is part of the key: credentials or an endpoint changed there mean another client.
    aws = sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_"))
    frozen = tuple(sorted((str(k), repr(v)) for k, v in options.items())) + tuple(aws)
    with _CACHE_LOCK:
        fs = _CACHE.get((protocol, frozen))
        if fs is not None:
            return fs
        try:
            import fsspec
        except ImportError:  # pragma: no cover - fsspec comes with torch
            raise ConfigurationError("object-store checkpoints need fsspec: pip install 'shardline[s3]'") from None
        kwargs = dict(options)
        if protocol in ("s3", "s3a"):
            # Listings must see what was just written (the commit record); s3fs caches them by default.
            kwargs.setdefault("use_listings_cache", False)
            kwargs.setdefault("skip_instance_cache", True)
        try:
            fs = fsspec.filesystem(protocol, **kwargs)
        except ImportError as e:
            extra = _EXTRAS.get(protocol)
            hint = f"pip install 'shardline[{extra}]'" if extra else f"install the fsspec backend for {protocol}://"
            raise ConfigurationError(
                f"checkpoints at {protocol}:// need an fsspec client for that protocol ({e}); {hint}"
            ) from None
        except ValueError as e:
            raise ConfigurationError(f"unknown storage protocol {protocol!r} ({e}); use s3://BUCKET/PREFIX") from None
        except TypeError as e:
            raise ConfigurationError(
                f"checkpoint.storage_options are not accepted by the {protocol}:// client: {e}"
            ) from None
        _CACHE[(protocol, frozen)] = fs
        return fs


def endpoint_of(fs: Any) -> str:
    """The endpoint ``fs`` talks to, for messages (the AWS default when none is configured)."""
    for source in (getattr(fs, "client_kwargs", None) or {}, getattr(fs, "kwargs", None) or {}):
        if source.get("endpoint_url"):
            return str(source["endpoint_url"])
    if getattr(fs, "endpoint_url", None):
        return str(fs.endpoint_url)
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "the AWS default endpoint"
