"""The manifest: what a checkpoint is, where it came from, and the SHA-256 of every file in it.

Layout of a committed checkpoint directory (e.g. ``checkpoints/step-100/``)::

    .metadata            DCP metadata (pickled by torch; plain ``torch.distributed.checkpoint`` reads it)
    __0_0.distcp ...     DCP data, __{rank}_{n}.distcp (files_per_rank files per rank)
    manifest.json        this module's record, in canonical JSON (see ``canonical.py``)
    manifest.sha256      "<manifest hash>  manifest.json" (``sha256sum -c`` format)
    SHA256SUMS           every other file's hash (``sha256sum -c SHA256SUMS``)

The manifest lists ``.metadata`` and the ``.distcp`` files; ``manifest.sha256`` and
``SHA256SUMS`` are derived from it, so they are checked against it rather than listed in it.
"""

from __future__ import annotations

import dataclasses
import datetime
import errno as errno_codes
import json
import operator
import os
import platform
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from shardline._version import __version__
from shardline.checkpoint.format.canonical import HASH_ALGORITHM, canonical_json, manifest_hash, sha256_hex
from shardline.checkpoint.integrity.hashing import FileDigest
from shardline.checkpoint.storage.protocol import COMMIT_RECORD, Location
from shardline.checkpoint.storage.stores import locate, store_for
from shardline.engine import subtree_units
from shardline.errors import CheckpointNotFoundError, CheckpointReadError, IntegrityError

__all__ = [
    "DCP_METADATA",
    "DERIVED_FILES",
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST",
    "MANIFEST_HASH_FILE",
    "STATEMENT_FILE",
    "SUMS_FILE",
    "build_manifest",
    "describe_units",
    "manifest_files",
    "named_manifest",
    "read_checkpoint_file",
    "read_error",
    "read_manifest",
    "recorded_manifest_hash",
    "render_manifest_hash_file",
    "render_sums",
]

FORMAT = "shardline.checkpoint"
FORMAT_VERSION = 1
MANIFEST = COMMIT_RECORD  # "manifest.json": the commit record of the storage protocol
MANIFEST_HASH_FILE = "manifest.sha256"
SUMS_FILE = "SHA256SUMS"
STATEMENT_FILE = "provenance.intoto.json"
"""The provenance statement (written by :mod:`shardline.checkpoint.provenance.statement`). Since it names the
manifest, the manifest cannot list it: ``SHA256SUMS`` does, and :mod:`.verify` checks it as a derived record."""
DCP_METADATA = ".metadata"
DERIVED_FILES = (MANIFEST, MANIFEST_HASH_FILE, SUMS_FILE)
_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)
_ORDER = operator.attrgetter("path", "rank", "bytes", "sha256")  # FileDigest's own order, without its __lt__
HASH_COVERS = (
    "sha256 of each file's bytes as written, computed while writing; the manifest hash is the sha256 of "
    "manifest.json, which is stored in canonical JSON (sorted keys, no whitespace, UTF-8, no floats)"
)


def _dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def _mixed_precision_json(mp: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for field in dataclasses.fields(mp):
        value = getattr(mp, field.name)
        out[field.name] = _dtype_name(value) if isinstance(value, torch.dtype) or value is None else value
    return out


def describe_units(model: nn.Module) -> list[dict[str, Any]]:
    """One record per unit of ``model``: name, strategy, shard x replicate sizes, mixed precision, sizes."""
    units = []
    for unit in subtree_units(model):
        units.append(
            {
                "name": unit.name,
                "strategy": unit.strategy.value,
                "shard_size": unit.mesh.shard_size,
                "replicate_size": unit.mesh.replicate_size,
                "master_dtype": "+".join(_dtype_name(d) or "" for d in unit.dtypes),
                "mixed_precision": _mixed_precision_json(unit.mixed_precision),
                "params": len(unit.params),
                "numel": unit.numel,
            }
        )
    return units


def _mesh(units: list[dict[str, Any]], world_size: int) -> dict[str, Any]:
    """The data-parallel mesh: (replicate, shard) when some unit is hybrid-sharded, else one dimension."""
    for u in units:
        replicas, shard = int(u.get("replicate_size", 1)), int(u.get("shard_size", 1))
        if replicas > 1 and shard > 1:
            return {"shape": [replicas, shard], "dim_names": ["replicate", "shard"]}
    return {"shape": [int(world_size)], "dim_names": ["dp"]}


def build_manifest(
    *,
    step: int,
    tag: str | None,
    kind: str,
    world_size: int,
    units: list[dict[str, Any]],
    model_info: Mapping[str, Any],
    contents: Mapping[str, bool],
    config_sha256: str | None,
    data_fingerprint: str | None,
    parent_manifest_sha256: str | None,
    files: Sequence[FileDigest],
    created: datetime.datetime | None = None,
    sharding: Mapping[str, Any] | None = None,
    run_tags: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The manifest dict of one checkpoint (plain JSON data, no floats).

    ``sharding`` (how the model or its state dict was sharded: ``state.engines.describe_sharding`` for a model,
    ``state.layout.describe_state_sharding`` for the DCP-native writer) is recorded when given; manifests written
    before it existed lack the key and stay valid. So are non-empty ``run_tags`` (``{key: value}`` strings the run is
    filed under), as ``run_tags``.
    """
    created = created or datetime.datetime.now(datetime.timezone.utc)
    root = units[-1] if units else None
    for u in units:
        if u["name"] == "":
            root = u
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "step": int(step),
        "tag": tag,
        "created_at": created.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        "created_unix_ns": (created - _EPOCH) // datetime.timedelta(microseconds=1) * 1000,
        "world_size": int(world_size),
        "mesh": _mesh(units, world_size),
        "state_dict_kind": kind,
        "strategies": {u["name"] or "<root>": u["strategy"] for u in units},
        "mixed_precision": root["mixed_precision"] if root else None,
        "units": units,
        "model": dict(model_info),
        "contents": dict(contents),
        "versions": {
            "shardline": __version__,
            "torch": torch.__version__.split("+")[0] if isinstance(torch.__version__, str) else str(torch.__version__),
            "python": platform.python_version(),
        },
        "config_sha256": config_sha256,
        "data_fingerprint": data_fingerprint,
        "parent_manifest_sha256": parent_manifest_sha256,
        "hash": {"algorithm": HASH_ALGORITHM, "covers": HASH_COVERS},
        "files": [f.to_json() for f in sorted(files, key=_ORDER)],
    }
    if sharding is not None:
        manifest["sharding"] = dict(sharding)
    if run_tags:
        manifest["run_tags"] = dict(run_tags)
    return manifest


def render_manifest_hash_file(digest: str) -> bytes:
    """Contents of ``manifest.sha256`` (``sha256sum -c`` format)."""
    return f"{digest}  {MANIFEST}\n".encode()


def render_sums(manifest_digest: str, files: Sequence[Mapping[str, Any]]) -> bytes:
    """Contents of ``SHA256SUMS``: every file of ``files`` plus ``manifest.json``, sorted by name, GNU format.

    ``files`` are the manifest's entries, and the provenance statement where the manifest does not list it
    (checkpoints saved since the statement names the manifest: docs/checkpoint-protocol.md).
    """
    rows = {str(f["path"]): str(f["sha256"]) for f in files}
    rows[MANIFEST] = manifest_digest
    return "".join([f"{digest}  {name}\n" for name, digest in sorted(rows.items())]).encode()


def manifest_files(manifest: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The ``files`` entries of a manifest, validated for shape."""
    files = manifest.get("files")
    if not isinstance(files, list) or not all(
        isinstance(f, dict) and {"path", "rank", "bytes", "sha256"} <= f.keys() for f in files
    ):
        raise IntegrityError("manifest.json has no valid 'files' list of {path, rank, bytes, sha256} entries")
    return files


def read_manifest(path: str | os.PathLike[str] | Location) -> tuple[dict[str, Any], str]:
    """``(manifest, manifest hash)`` of the checkpoint at ``path``, checked against ``manifest.sha256``.

    Raises:
        CheckpointNotFoundError: ``path`` is not a directory or has no ``manifest.json``.
        IntegrityError: ``manifest.json`` is not canonical JSON of a shardline manifest, or its
            hash differs from the one recorded in ``manifest.sha256`` (or that file is missing).
        CheckpointReadError: a file exists but cannot be read (``EIO``, ``ESTALE``, ``EACCES``...):
            not damage, so callers must not treat the checkpoint as damaged.
    """
    path = locate(path)
    if not path.is_dir():
        what = store_for(path).absent
        raise CheckpointNotFoundError(f"{path} is not a checkpoint: {what}")
    file = path / MANIFEST
    if not file.is_file():
        raise CheckpointNotFoundError(
            f"{path} has no {MANIFEST}: it is not a committed shardline checkpoint "
            f"(contents: {', '.join(sorted(p.name for p in path.iterdir())[:8]) or 'empty'})"
        )
    raw = read_checkpoint_file(file)
    try:
        manifest = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise IntegrityError(f"{file} is altered or damaged: not valid UTF-8 JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise IntegrityError(f"{file} is not a shardline manifest (format {manifest.get('format')!r})")
    try:
        digest = manifest_hash(manifest)
    except Exception as e:
        raise IntegrityError(f"{file} is altered: it cannot be put in canonical form ({e})") from None
    if canonical_json(manifest) != raw:
        raise IntegrityError(
            f"{file} is altered: its bytes are not the canonical JSON shardline writes (sha256 of file "
            f"{sha256_hex(raw)} vs canonical {digest})"
        )
    recorded = recorded_manifest_hash(path)
    if recorded is None:
        raise IntegrityError(f"{path / MANIFEST_HASH_FILE} is missing or unreadable; the checkpoint is not committed")
    if recorded != digest:
        raise IntegrityError(
            f"manifest hash mismatch in {path}: {MANIFEST} hashes to {digest} but {MANIFEST_HASH_FILE} records "
            f"{recorded}; one of them was altered"
        )
    return manifest, digest


def read_checkpoint_file(file: Location) -> bytes:
    """The bytes of ``file``.

    Raises:
        FileNotFoundError: it does not exist (callers report it missing).
        CheckpointReadError: it exists but cannot be read -- an error of the file system or of
            permissions, which says nothing about the checkpoint's integrity.
    """
    try:
        return file.read_bytes()
    except FileNotFoundError:
        raise
    except OSError as e:
        raise read_error(file, e) from e


def read_error(file: Location, error: OSError) -> CheckpointReadError:
    """The error for a checkpoint file that exists but cannot be read: named, with its errno, and not damage."""
    code = errno_codes.errorcode.get(error.errno or -1)
    return CheckpointReadError(
        f"cannot read {file}: {code + ' ' if code else ''}{error.strerror or error}. This is an I/O or permission "
        "error, not damage: nothing was moved aside or changed. Fix the file system or the permissions (a network "
        "mount that went stale, a disk error), then retry."
    )


def recorded_manifest_hash(path: Location) -> str | None:
    """The hash ``manifest.sha256`` at ``path`` records (None: missing or not in its format)."""
    try:
        text = read_checkpoint_file(path / MANIFEST_HASH_FILE).decode("ascii")
    except (FileNotFoundError, UnicodeDecodeError):
        return None
    parts = text.split()
    if len(parts) != 2 or parts[1] != MANIFEST or len(parts[0]) != 64:
        return None
    return parts[0]


def named_manifest(raw: bytes) -> str | None:
    """The manifest hash a provenance statement (its bytes) names as its one subject; None for the earlier form
    (per-file subjects) or bytes that are not such a statement."""
    try:
        statement = json.loads(raw.decode("utf-8"))
        subject = statement["subject"]
        if len(subject) == 1 and subject[0]["name"] == MANIFEST:
            return str(subject[0]["digest"]["sha256"])
    except Exception:
        return None
    return None
