"""Checkpoint locations in object stores (``s3://bucket/prefix``) through fsspec, shaped like ``pathlib.Path``.

Note: why a path-shaped class. The readers and verifiers of a checkpoint (``manifest.py``,
``verify.py``, ``opening.py``, ``reading.py``, ``directory.scan``) only ever ask a location for
the operations below -- join a name, list, stat, read, open for streaming -- so an
:class:`ObjectPath` answering them through an fsspec file system lets the same code check a
checkpoint in a bucket, byte for byte as on a disk. It deliberately has no ``__fspath__``:
handing one to ``open()``, ``os.*`` or ``shutil`` fails loudly instead of creating a local
directory named ``s3:``.

What an object store lacks, and what the save does instead (``save.py``):

* no atomic rename: a checkpoint is written in place under ``<dir>/step-N/``, and
  ``manifest.json`` -- written last, after every object it lists -- is the commit record; a
  prefix without one is never listed, loaded or resumed (``directory.scan`` skips it);
* no fsync: an upload is durable when the store acknowledges it (the writers pass
  ``sync_files=False``);
* no directories: a "directory" is the prefix of the objects below it.

Credentials and the endpoint come from the standard AWS environment (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ...) or from ``storage_options`` (passed to
the fsspec file system, e.g. ``{"endpoint_url": ..., "key": ..., "secret": ...}``). The ``s3``
protocol needs the ``shardline[s3]`` extra (s3fs).
"""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from shardline.checkpoint.storage.object_clients import SCHEME_SEP, endpoint_of, filesystem, split_url
from shardline.checkpoint.storage.object_errors import first_line, precondition_failed
from shardline.checkpoint.storage.object_listing import by_folder, deep_listing, empty_folders
from shardline.checkpoint.storage.object_versions import purge_versions, versioned
from shardline.errors import StorageAccessError

__all__ = [
    "Location",
    "ObjectPath",
    "as_location",
    "check_access",
    "delete_object",
    "describe",
    "is_url",
    "split_url",
]


def is_url(path: object) -> bool:
    """Whether ``path`` names an object-store location (``proto://...``) rather than a local path."""
    if isinstance(path, ObjectPath):
        return True
    if isinstance(path, os.PathLike):
        return False
    text = str(path)
    scheme, sep, _ = text.partition(SCHEME_SEP)
    return bool(sep) and scheme.isidentifier() and scheme != "file"


@dataclass(frozen=True)
class _Stat:
    st_size: int


_ABSENT = ("absent", 0)


class ObjectPath:
    """A location in an object store: ``protocol://key``, with the subset of ``pathlib.Path`` checkpoints use.

    Build one with :func:`as_location`. Equal when protocol and key are equal.
    """

    __slots__ = ("_deep", "_entry", "_folders", "_fs", "_listing", "key", "protocol")

    def __init__(
        self,
        fs: Any,
        protocol: str,
        key: str,
        *,
        listing: dict[str, tuple[str, int]] | None = None,
        entry: tuple[str, int] | None = None,
        deep: bool = False,
    ) -> None:
        self._fs = fs
        self.protocol = protocol
        self.key = key.strip("/")
        self._listing = listing  # a snapshot's children: name -> (type, size)
        self._entry = entry  # this object's (type, size) in its parent's snapshot; ("absent", 0) if not there
        self._deep = deep  # the listing holds every object below, by relative path (snapshot(deep=True))
        self._folders: dict[str, dict[str, tuple[str, int]]] | None = None  # its listing by first folder, once

    # ------------------------------------------------------------------ naming
    def __str__(self) -> str:
        return f"{self.protocol}{SCHEME_SEP}{self.key}"

    def __repr__(self) -> str:
        return f"ObjectPath({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ObjectPath) and (self.protocol, self.key) == (other.protocol, other.key)

    def __lt__(self, other: ObjectPath) -> bool:
        return (self.protocol, self.key) < (other.protocol, other.key)

    def __hash__(self) -> int:
        return hash((self.protocol, self.key))

    def __truediv__(self, name: str | os.PathLike[str]) -> ObjectPath:
        name = os.fspath(name)
        entry, listing, relative = None, None, name.strip("/")
        if self._listing is not None and ("/" not in relative or self._deep):
            entry = self._listing.get(relative, _ABSENT)
            if self._deep and entry[0] == "directory":  # a folder of a deep snapshot answers from it too
                if "/" not in relative:
                    self._folders = self._folders if self._folders is not None else by_folder(self._listing)
                    listing = self._folders.get(relative, {})
                else:
                    start = relative + "/"
                    listing = {k[len(start) :]: v for k, v in self._listing.items() if k.startswith(start)}
        key = posixpath.join(self.key, name)
        return ObjectPath(self._fs, self.protocol, key, listing=listing, entry=entry, deep=listing is not None)

    def snapshot(self, *, deep: bool = False) -> ObjectPath:
        """This prefix with one listing of its children taken now (one LIST request; ``deep``: of every object
        below it, folders included, in as many LIST pages as there are thousands of objects).

        Note: a checkpoint is checked file by file (present? its size?), which on an object store
        would cost a HEAD request per file per question. A snapshot answers those from a single
        listing; bytes are still read from the store, and hashed, so a file replaced after the
        listing shows as altered, never as intact. A checkpoint (data files in ``shards/GGGG/``,
        :mod:`.key_prefixes`) is listed ``deep``: as many pages as a flat listing, and every file.
        """
        if deep:
            listing = deep_listing(self._fs, self.key)
            return ObjectPath(self._fs, self.protocol, self.key, listing=listing, entry=self._entry, deep=True)
        listing = {}
        try:
            entries = self._fs.ls(self.key, detail=True)
        except FileNotFoundError:
            entries = []
        for e in entries:
            if str(e["name"]).strip("/") == self.key:
                continue  # an empty prefix a store with directories keeps lists itself
            name = posixpath.basename(str(e["name"]).rstrip("/"))
            if name:
                listing[name] = (str(e.get("type") or "file"), int(e.get("size") or 0))
        return ObjectPath(self._fs, self.protocol, self.key, listing=listing, entry=self._entry)

    def files(self) -> list[str]:
        """The files of a deep snapshot (:meth:`snapshot`), by path relative to it, sorted (ValueError if not one)."""
        if self._listing is None or not self._deep:
            raise ValueError(f"{self} is not a deep snapshot: take one with snapshot(deep=True)")
        return sorted(name for name, (kind, _) in self._listing.items() if kind == "file")

    @property
    def fs(self) -> Any:
        """The fsspec file system this location is read and written through."""
        return self._fs

    @property
    def name(self) -> str:
        return posixpath.basename(self.key)

    @property
    def parent(self) -> ObjectPath:
        parent = posixpath.dirname(self.key)
        return ObjectPath(self._fs, self.protocol, parent or self.key)

    @property
    def bucket(self) -> str:
        return self.key.split("/", 1)[0]

    @property
    def endpoint(self) -> str:
        return endpoint_of(self._fs)

    def with_name(self, name: str) -> ObjectPath:
        return self.parent / name

    def absolute(self) -> ObjectPath:
        return self

    # ------------------------------------------------------------------ queries
    def exists(self) -> bool:
        if self._listing is not None:
            return bool(self._listing)
        if self._entry is not None:
            return self._entry is not _ABSENT
        return bool(self._fs.exists(self.key))

    def is_dir(self) -> bool:
        if self._listing is not None:
            return bool(self._listing)
        if self._entry is not None:
            return self._entry[0] == "directory"
        return bool(self._fs.isdir(self.key))

    def is_file(self) -> bool:
        if self._entry is not None and self._listing is None:
            return self._entry[0] == "file"
        return bool(self._fs.isfile(self.key))

    def is_symlink(self) -> bool:
        return False

    def stat(self) -> _Stat:
        if self._entry is not None and self._listing is None:
            if self._entry is _ABSENT:
                raise FileNotFoundError(2, "no such object", str(self))
            return _Stat(self._entry[1])
        info = self._fs.info(self.key)
        return _Stat(int(info.get("size") or 0))

    def iterdir(self) -> Iterator[ObjectPath]:
        if self._listing is not None:
            for name in sorted(n for n in self._listing if "/" not in n):
                yield self / name
            return
        for entry in self._fs.ls(self.key, detail=False):
            if str(entry).strip("/") == self.key:
                continue  # an empty prefix a store with directories keeps lists itself
            name = posixpath.basename(str(entry).rstrip("/"))
            if name:
                yield self / name

    # ------------------------------------------------------------------ bytes
    def open(self, mode: str = "rb", **kwargs: Any) -> BinaryIO:
        if "b" not in mode:
            raise ValueError("object-store checkpoint files are opened in binary mode only")
        if "r" in mode:
            # Streaming reads in 8 MiB ranged GETs ahead of the reader (a resharded load seeks past
            # what it skips, so only the blocks it needs are fetched); the size from a snapshot saves a HEAD.
            kwargs.setdefault("cache_type", "readahead")
            kwargs.setdefault("block_size", 8 << 20)
            if self._entry is not None and self._entry is not _ABSENT and self._listing is None:
                kwargs.setdefault("size", self._entry[1])
        file: BinaryIO = self._fs.open(self.key, mode, **kwargs)  # an fsspec file: binary, file-like
        return file

    def read_bytes(self) -> bytes:
        return bytes(self._fs.cat_file(self.key))

    def read_text(self, encoding: str = "utf-8") -> str:
        return self.read_bytes().decode(encoding)

    def write_bytes(self, data: bytes) -> int:
        self._fs.pipe_file(self.key, bytes(data))
        return len(data)

    def write_new(self, data: bytes) -> None:
        """Create this object only if there is none: a conditional PUT (``If-None-Match: *``).

        Note: S3 has honoured the header since 2024 (AWS), as do SeaweedFS 4.x and MinIO; the
        store checks and writes in one step, so of two concurrent writers exactly one succeeds.
        A store that ignores the header would let both succeed -- callers that rely on this
        re-read what they wrote (see ``save.py``). Other fsspec protocols fall back to a check
        and a write, which a concurrent writer can slip between.

        Note: a retried PUT. When the response to the PUT is lost (a reset connection, a load
        balancer's timeout), the client sends it again, and the store -- which created the object
        the first time -- answers the retry with 412. So a refusal is checked: the object is read
        back, and if it holds exactly ``data`` the write was this one's, and it succeeded; so is a
        PUT whose retries all ended without an answer (the first may have landed). Callers
        make ``data`` unique (a claim carries a nonce, a manifest its file digests and creation
        time), so equal bytes cannot be another writer's.

        Raises:
            FileExistsError: another object is there already (the store refused the precondition).
        """
        if self.protocol in ("s3", "s3a"):
            try:
                self._fs.pipe_file(self.key, bytes(data), IfNoneMatch="*")
            except Exception as e:  # s3fs's OSError, or botocore's own class once its retries ran out unanswered
                refused = precondition_failed(e)
                try:
                    ours = self.read_bytes() == bytes(data)
                except Exception:  # not there, or the store still failing: not known to be ours
                    ours = False
                if ours:
                    return
                if refused:
                    raise FileExistsError(errno.EEXIST, "an object exists there already", str(self)) from None
                raise
            return
        if self._fs.exists(self.key):
            raise FileExistsError(errno.EEXIST, "an object exists there already", str(self))
        self._fs.pipe_file(self.key, bytes(data))

    def unlink(self) -> None:
        """Delete this object (nothing if there is none); in a bucket that keeps versions, every version of it.

        See :meth:`remove_tree` for why versions go too.
        """
        if versioned(self._fs, self.protocol, self.bucket):
            purge_versions(self._fs, self.key, exact=True)
            return
        with contextlib.suppress(FileNotFoundError):
            self._fs.rm_file(self.key)

    def abort_uploads(self) -> int:
        """Abort the multipart uploads in progress under this prefix (a writer killed mid-upload leaves its
        parts stored, and billed, until they are aborted); how many there were."""
        call = getattr(self._fs, "call_s3", None)
        if call is None or "/" not in self.key:
            return 0
        bucket, key = self.key.split("/", 1)
        aborted = 0
        markers: dict[str, str] = {}
        while True:
            page = call("list_multipart_uploads", Bucket=bucket, Prefix=key + "/", **markers)
            for upload in page.get("Uploads") or []:
                call("abort_multipart_upload", Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
                aborted += 1
            if not page.get("IsTruncated"):
                return aborted
            markers = {"KeyMarker": page["NextKeyMarker"], "UploadIdMarker": page["NextUploadIdMarker"]}

    def remove_tree(self) -> None:
        """Delete every object under this prefix (nothing if there is none), the multipart uploads in progress
        there, and the prefix's own marker.

        Note: stores backed by a file system (SeaweedFS's filer, for one) keep an empty directory
        after its objects are deleted, and list it as a common prefix -- so a later save of the same
        step would find its prefix "taken". Deleting the ``prefix/`` key removes it; on S3 proper
        that key does not exist and the delete is a no-op.

        Note: a bucket that keeps versions. There a plain delete only adds a delete marker: the
        object stops being listed, and every byte of it stays stored (and billed) as a noncurrent
        version -- retention would free nothing. So in a bucket whose versioning is enabled (or
        suspended, with versions from before) every version of every object under the prefix, and
        every delete marker, is deleted by version id. Where the credentials may not read the
        bucket's versioning or delete versions, the objects are deleted plainly and a
        :class:`~shardline.errors.CheckpointWarning` names the lifecycle rule that frees the space
        instead (``NoncurrentVersionExpiration``).
        """
        self.abort_uploads()
        purged = versioned(self._fs, self.protocol, self.bucket) and purge_versions(
            self._fs, self.key + "/", exact=False
        )
        if not purged and self._fs.exists(self.key):
            self._fs.rm(self.key, recursive=True)
        call = getattr(self._fs, "call_s3", None)
        if call is None or "/" not in self.key:
            return
        bucket = self.bucket
        # Nested folders a store with directories keeps (a bucket save's shards/GGGG/, key_prefixes.py), deepest
        # first, then the prefix's own; S3 proper lists none (one LIST).
        for folder in [*reversed(empty_folders(self._fs, self.key)), self.key]:
            # In a versioned bucket a delete of a key that is not there adds a delete marker: only when still listed.
            if folder != self.key or not purged or self._fs.exists(self.key):
                call("delete_object", Bucket=bucket, Key=folder.split("/", 1)[1] + "/")


Location = Path | ObjectPath
"""Where a checkpoint (or a directory of them) lives: a local path, or a location in an object store."""


def as_location(
    path: str | os.PathLike[str] | ObjectPath, *, storage_options: Mapping[str, Any] | None = None
) -> Location:
    """``path`` as a :class:`pathlib.Path` (local) or an :class:`ObjectPath` (``proto://bucket/prefix``).

    ``storage_options`` go to the fsspec file system of a URL (ignored for a local path).

    Raises:
        ConfigurationError: a URL naming no bucket, an unknown protocol, or a missing client library.
    """
    if isinstance(path, ObjectPath):
        return path
    if not is_url(path):
        return Path(path)
    protocol, key = split_url(str(path))
    return ObjectPath(filesystem(protocol, storage_options or {}), protocol, key)


def describe(location: object) -> str:
    """``location`` for a message: the URL and its endpoint for an object store, the path otherwise."""
    if isinstance(location, ObjectPath):
        return f"{location} (endpoint {location.endpoint})"
    return str(location)


def check_access(location: object) -> None:
    """Check that the bucket of ``location`` exists and the credentials may list it (no-op for local paths).

    Raises:
        StorageAccessError: the bucket does not exist, the credentials are refused, or the endpoint
            does not answer; the message names the endpoint and bucket and how to fix it.
    """
    if not isinstance(location, ObjectPath):
        return
    where = f"bucket {location.bucket!r} at {location.endpoint}"
    try:
        location.fs.info(location.bucket)  # one HEAD of the bucket (a listing could be long)
    except PermissionError as e:
        raise StorageAccessError(
            f"access to {where} was refused ({first_line(e)}) for {location}: check the credentials "
            "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, or checkpoint.storage_options key/secret)"
        ) from None
    except FileNotFoundError:
        raise StorageAccessError(
            f"{where} does not exist (location {location}): create it, or fix the bucket name in the URL"
        ) from None
    except OSError as e:
        raise StorageAccessError(
            f"cannot reach {where} for {location} ({type(e).__name__}: {first_line(e)}): check the endpoint "
            "(AWS_ENDPOINT_URL or checkpoint.storage_options endpoint_url) and that the server is up"
        ) from None
    except Exception as e:  # botocore raises its own classes for an unreachable endpoint
        raise StorageAccessError(
            f"cannot reach {where} for {location} ({type(e).__name__}: {first_line(e)}): check the endpoint "
            "(AWS_ENDPOINT_URL or checkpoint.storage_options endpoint_url) and that the server is up"
        ) from None


def delete_object(fs: Any, key: str) -> None:
    """Delete the object ``key`` ("bucket/key") of the fsspec file system ``fs``: every version of it in a bucket
    that keeps versions (see :meth:`ObjectPath.remove_tree`)."""
    protocol = fs.protocol[0] if isinstance(fs.protocol, (tuple, list)) else str(fs.protocol)
    ObjectPath(fs, protocol, key).unlink()
