"""``shardline inspect``: what a checkpoint is, in words a non-engineer can read (and as JSON)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from shardline.checkpoint.integrity.manifest import manifest_files, read_manifest
from shardline.checkpoint.provenance.statement import STATEMENT_FILE
from shardline.checkpoint.storage.protocol import Location
from shardline.checkpoint.storage.stores import local_path, locate, store_for

__all__ = ["human_bytes", "render_summary", "summarize"]


def human_bytes(n: int) -> str:
    """``28.4 GB`` style (decimal units, as disks are sold)."""
    value = float(n)
    for unit in ("bytes", "KB", "MB", "GB", "TB", "PB"):
        if value < 1000 or unit == "PB":
            return f"{int(value)} bytes" if unit == "bytes" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{n} bytes"


def _count(n: int) -> str:
    for limit, word in ((10**12, "trillion"), (10**9, "billion"), (10**6, "million")):
        if n >= limit:
            return f"{n / limit:.1f} {word}"
    return f"{n:,}"


def summarize(
    path: str | os.PathLike[str] | Location, *, storage_options: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """A JSON-able summary of the checkpoint at ``path`` from its manifest (files are not re-hashed).

    ``storage_options`` go to the fsspec file system of a URL (default: the standard AWS environment).

    Raises:
        CheckpointNotFoundError, IntegrityError: as :func:`~shardline.checkpoint.integrity.manifest.read_manifest`.
        StorageAccessError: a URL whose bucket, credentials or endpoint cannot be used.
    """
    root = locate(path, storage_options=storage_options)  # a local directory or an object-store URL
    store_for(root).check_access(root)
    manifest, digest = read_manifest(root)
    listed = manifest_files(manifest)
    files = [f for f in listed if f["path"] != STATEMENT_FILE]
    shards = [f for f in files if str(f["path"]).endswith(".distcp")]
    units = manifest.get("units", [])
    strategies = sorted({u["strategy"] for u in units})
    return {
        "path": str(root.absolute()),
        "step": manifest["step"],
        "tag": manifest.get("tag"),
        "created_at": manifest.get("created_at"),
        "world_size": manifest.get("world_size"),
        "state_dict_kind": manifest.get("state_dict_kind"),
        "shard_files": len(shards),
        "files": len(files),
        "total_bytes": sum(int(f["bytes"]) for f in files),
        "parameters": manifest.get("model", {}).get("parameters"),
        "units": len(units),
        "strategies": strategies,
        "mixed_precision": manifest.get("mixed_precision"),
        "contents": manifest.get("contents", {}),
        "versions": manifest.get("versions", {}),
        "config_sha256": manifest.get("config_sha256"),
        "data_fingerprint": manifest.get("data_fingerprint"),
        "parent_manifest_sha256": manifest.get("parent_manifest_sha256"),
        "manifest_sha256": digest,
        "provenance_statement": STATEMENT_FILE if len(files) != len(listed) else None,
        "adopted": manifest.get("adopted"),
    }


def render_summary(s: dict[str, Any]) -> str:
    """The human-readable paragraph(s) for :func:`summarize`'s output."""
    kind = "saved when training stopped on an error" if s.get("tag") == "on_exception" else "a regular save"
    contents = s.get("contents", {})
    held = ["the model weights"]
    if contents.get("optimizer"):
        held.append("the optimizer state")
    if contents.get("trainer_state"):
        held.append("the trainer state (step, random-number generators, data position)")
    mp = s.get("mixed_precision") or {}
    precision = f", computing in {mp['param_dtype']}" if mp.get("param_dtype") else ""
    versions = s.get("versions", {})
    adopted = s.get("adopted")
    if isinstance(adopted, dict):
        kind = "written by another tool"
        writers = f"{s['world_size'] or 'an unknown number of'} process{'es' if s['world_size'] != 1 else ''}"
        written = f"written by {writers}, adopted on {s.get('created_at', '?')}"
    else:
        written = (
            f"written by {s['world_size']} process{'es' if s['world_size'] != 1 else ''} on "
            f"{s.get('created_at', '?')} with shardline {versions.get('shardline', '?')} and torch "
            f"{versions.get('torch', '?')}"
        )
    lines = [
        f"Checkpoint at training step {s['step']:,} ({kind}) consists of {s['shard_files']} shard "
        f"file{'s' if s['shard_files'] != 1 else ''} totaling {human_bytes(s['total_bytes'])} "
        f"({s['files']} files with the index), {written}.",
        f"It holds {', '.join(held[:-1]) + ' and ' + held[-1] if len(held) > 1 else held[0]}: "
        f"{_count(s['parameters'] or 0)} parameters in {s['units']} sharded unit{'s' if s['units'] != 1 else ''} "
        f"({', '.join(x.upper() for x in s['strategies']) or 'unsharded'}{precision}). It can be loaded at any number "
        "of processes and with any sharding strategy.",
    ]
    if isinstance(adopted, dict):
        lines.append(
            f"It was written by another tool and adopted by {adopted.get('by', 'shardline')} on "
            f"{adopted.get('at', '?')}: its hashes were {adopted.get('hashes', 'taken after the fact')}. Not known "
            f"from its files: {', '.join(str(u).replace('_', ' ') for u in adopted.get('unknown', [])) or 'nothing'}."
        )
    if s.get("parent_manifest_sha256"):
        lines.append(f"It continues from the checkpoint whose manifest hash is {s['parent_manifest_sha256']}.")
    elif not isinstance(adopted, dict):
        lines.append("It has no parent: training started from scratch (or from weights outside shardline).")
    if s.get("config_sha256"):
        lines.append(f"Training configuration fingerprint: {s['config_sha256']}.")
    if s.get("data_fingerprint"):
        lines.append(f"Training data fingerprint: {s['data_fingerprint']}.")
    if s.get("provenance_statement"):
        lines.append(
            f"Where it came from (config, data, parent, code version, torch version, world size, strategy) is stated "
            f"in {s['provenance_statement']}, an in-toto statement that the manifest lists like the data files."
        )
    lines.append(
        f"The manifest hash {s['manifest_sha256']} is a fingerprint of the complete checkpoint: it covers the "
        "SHA-256 of every file, so changing any byte of any file changes it. To check the files, run "
        f"`shardline verify {s['path']}`, or `sha256sum -c SHA256SUMS` inside the directory"
        + (" (a copy of it: the files are in an object store)" if local_path(s["path"]) is None else "")
        + " (see docs/verification.md)."
    )
    return "\n".join(lines)
