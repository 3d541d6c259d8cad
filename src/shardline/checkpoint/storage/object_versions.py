"""Deleting from a bucket that keeps versions: whether it does (asked once a minute per bucket), and every version
and delete marker of a key or a prefix deleted by version id; where the store will not say or will not delete so,
a warning (once per bucket) names the lifecycle rule that frees the space. See ``ObjectPath.remove_tree``.
"""

from __future__ import annotations

import errno
import logging
import time
import warnings
from typing import Any

from shardline.checkpoint.storage.object_clients import endpoint_of
from shardline.checkpoint.storage.object_errors import first_line
from shardline.errors import CheckpointWarning

__all__ = ["purge_versions", "versioned"]

log = logging.getLogger(__name__)

_WARNED: set[str] = set()
# (endpoint, bucket) -> (keeps versions, when asked): asked again after a minute (versioning can be turned on).
_VERSIONING: dict[tuple[str, str], tuple[bool, float]] = {}
_VERSIONING_TTL_S = 60.0


def versioned(fs: Any, protocol: str, bucket: str) -> bool:
    """Whether ``bucket`` keeps versions (versioning enabled, or suspended with versions from before).

    One ``GetBucketVersioning`` request; a store that will not say (no permission, not implemented) counts as
    not versioned, with a warning (once per bucket) naming the lifecycle rule that frees noncurrent versions.
    """
    call = getattr(fs, "call_s3", None)
    if call is None or protocol not in ("s3", "s3a"):
        return False
    cached = _VERSIONING.get((endpoint_of(fs), bucket))
    if cached is not None and time.monotonic() - cached[1] < _VERSIONING_TTL_S:
        return cached[0]
    try:
        status = call("get_bucket_versioning", Bucket=bucket).get("Status")
    except Exception as e:  # botocore's own classes for a refusal, s3fs's OSError for the rest
        _warn_versions(bucket, f"its versioning could not be read ({type(e).__name__}: {first_line(e)})")
        return False
    keeps = status in ("Enabled", "Suspended")
    _VERSIONING[(endpoint_of(fs), bucket)] = (keeps, time.monotonic())
    return keeps


def purge_versions(fs: Any, key: str, *, exact: bool) -> bool:
    """Delete every version and delete marker of ``key`` (``exact``) or of every key under the prefix ``key``.

    Returns False, having deleted nothing, when the store refuses to delete by version (the caller then deletes
    plainly; a warning names the lifecycle rule to set).
    """
    bucket, prefix = key.split("/", 1)
    found: list[dict[str, str]] = []
    markers: dict[str, str] = {}
    while True:
        page = fs.call_s3("list_object_versions", Bucket=bucket, Prefix=prefix, **markers)
        for entry in [*(page.get("Versions") or []), *(page.get("DeleteMarkers") or [])]:
            if not exact or entry["Key"] == prefix:
                found.append({"Key": entry["Key"], "VersionId": entry["VersionId"]})
        if not page.get("IsTruncated"):
            break
        markers = {"KeyMarker": page["NextKeyMarker"], "VersionIdMarker": page["NextVersionIdMarker"]}
    for start in range(0, len(found), 1000):  # DeleteObjects takes 1000 keys a request
        try:
            answer = fs.call_s3(
                "delete_objects", Bucket=bucket, Delete={"Objects": found[start : start + 1000], "Quiet": True}
            )
        except PermissionError as e:
            _warn_versions(bucket, f"deleting by version id was refused ({first_line(e)})")
            return False
        errors = answer.get("Errors") or []
        if errors:
            first = errors[0]
            if str(first.get("Code")) == "AccessDenied":
                _warn_versions(bucket, f"deleting by version id was refused ({first.get('Message')})")
                return False
            raise OSError(
                errno.EIO, f"deleting {len(errors)} object version(s) failed: {first.get('Code')}: "
                f"{first.get('Message')} ({first.get('Key')} version {first.get('VersionId')})",
            )  # fmt: skip
    return True


def _warn_versions(bucket: str, why: str) -> None:
    if bucket in _WARNED:
        return
    _WARNED.add(bucket)
    message = (
        f"bucket {bucket!r}: {why}; if the bucket keeps versions, a checkpoint deleted (retention, a quarantine "
        "move, a cleared leftover) stays stored as noncurrent versions. Allow s3:GetBucketVersioning and "
        "s3:DeleteObjectVersion to the credentials, or give the bucket a lifecycle rule that expires noncurrent "
        "versions (NoncurrentVersionExpiration, e.g. NoncurrentDays=1)."
    )
    log.warning("%s", message)
    warnings.warn(message, CheckpointWarning, stacklevel=3)
