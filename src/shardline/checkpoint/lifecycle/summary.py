"""``shardline inspect``: what a checkpoint is, in words a non-engineer can read (and as JSON)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from shardline.checkpoint.integrity.manifest import manifest_files, read_manifest
from shardline.checkpoint.provenance.statement import STATEMENT_FILE
from shardline.checkpoint.storage.protocol import Location
from shardline.checkpoint.storage.stores import local_path, locate, store_for

__all__ = ["human_bytes", "render_summary", "sharding_words", "summarize"]


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
        "sharding": manifest.get("sharding"),
        "contents": manifest.get("contents", {}),
        "versions": manifest.get("versions", {}),
        "config_sha256": manifest.get("config_sha256"),
        "data_fingerprint": manifest.get("data_fingerprint"),
        "parent_manifest_sha256": manifest.get("parent_manifest_sha256"),
        "manifest_sha256": digest,
        # listed in the manifest (the earlier form), or a derived record beside it naming the manifest
        "provenance_statement": STATEMENT_FILE
        if len(files) != len(listed) or (root / STATEMENT_FILE).is_file()
        else None,
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
    layout = (
        f"{s['units']} sharded unit{'s' if s['units'] != 1 else ''} "
        f"({', '.join(x.upper() for x in s['strategies']) or 'unsharded'}{precision})"
    )
    sharding = sharding_words(s.get("sharding"))
    lines = [
        f"Checkpoint at training step {s['step']:,} ({kind}) consists of {s['shard_files']} shard "
        f"file{'s' if s['shard_files'] != 1 else ''} totaling {human_bytes(s['total_bytes'])} "
        f"({s['files']} files with the index), {written}.",
        f"It holds {', '.join(held[:-1]) + ' and ' + held[-1] if len(held) > 1 else held[0]}: "
        f"{_count(s['parameters'] or 0)} parameters"
        + (f" in {layout}" if sharding is None else "")
        + ". It can be loaded at any number of processes and with any sharding strategy"
        + (" or engine (shardline, torch FSDP2, FSDP1, DDP, a plain model)." if sharding is not None else "."),
    ]
    if isinstance(adopted, dict):
        lines.append(
            f"It was written by another tool and adopted by {adopted.get('by', 'shardline')} on "
            f"{adopted.get('at', '?')}: its hashes were {adopted.get('hashes', 'taken after the fact')}. Not known "
            f"from its files: {', '.join(str(u).replace('_', ' ') for u in adopted.get('unknown', [])) or 'nothing'}."
        )
    if sharding is not None:
        lines.append(sharding)
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


def _precision(policy: Mapping[str, Any] | None) -> str:
    dtype = (policy or {}).get("param_dtype")
    return f"parameters computed in {dtype}" if dtype else "no mixed precision"


def _tally(values: list[str], noun: str = "modules") -> str:
    counts: dict[str, int] = {}
    for value in values:
        counts[value] = counts.get(value, 0) + 1
    return "; ".join(
        f"{value} ({n} {noun if n != 1 else noun.removesuffix('s')})" if len(counts) > 1 else value
        for value, n in counts.items()
    )


def _state_dict_layout_words(sharding: Mapping[str, Any]) -> str:
    """The DCP-native writer's ``sharding`` section (each tensor's layout, ``state.layout``) in plain words."""
    meshes: list[Mapping[str, Any]] = list(sharding.get("meshes", []))
    tensors: Mapping[str, Any] = sharding.get("tensors", {})
    plain = sum(1 for t in tensors.values() if not isinstance(t, Mapping))
    layouts = [
        " x ".join(str(n) for n in meshes[int(t["mesh"])].get("shape", []))
        + (f" ({' x '.join(meshes[int(t['mesh'])]['dim_names'])})" if meshes[int(t["mesh"])].get("dim_names") else "")
        + " mesh, "
        + ", ".join(str(p) for p in t.get("placements", []))
        for t in tensors.values()
        if isinstance(t, Mapping)
    ]
    sharded = f"{len(layouts)} distributed tensor{'s' if len(layouts) != 1 else ''}" + (
        f" placed {_tally(layouts, 'tensors')}" if layouts else ""
    )
    return (
        "It was written through torch.distributed.checkpoint by code that sharded the model itself (shardline's "
        f"DCP writer), so the engine is not recorded; its state dict held {sharded} and {plain} "
        f"tensor{'s' if plain != 1 else ''} every process held whole."
    )


def sharding_words(sharding: Mapping[str, Any] | None) -> str | None:
    """The manifest's ``sharding`` section in plain words (None for shardline's own units or an older manifest)."""
    if sharding is not None and sharding.get("source") == "state_dict":
        return _state_dict_layout_words(sharding)
    engine = (sharding or {}).get("engine")
    if sharding is None or engine in (None, "shardline"):
        return None
    if engine == "ddp":
        return "It was trained with torch DistributedDataParallel: every parameter is replicated on every process."
    if engine == "plain":
        return "It was trained without sharding: every parameter is whole (replicated) in one model."
    modules: Mapping[str, Mapping[str, Any]] = sharding.get("modules", {})
    if engine == "fsdp1":
        return (
            f"It was sharded by torch FullyShardedDataParallel (FSDP1) in {len(modules)} wrapped "
            f"module{'s' if len(modules) != 1 else ''}, sharding strategy "
            f"{_tally([str(m.get('sharding_strategy')) for m in modules.values()])}, "
            f"{_tally([_precision(m.get('mixed_precision')) for m in modules.values()])}; the shards were saved as "
            f"{sharding.get('state_dict_type', '?')}."
        )
    mesh = sharding.get("mesh") or {}
    shape = [int(n) for n in mesh.get("shape", [])]
    names = mesh.get("dim_names")
    where = (
        f"a 1-D mesh of {shape[0]} rank{'s' if shape[0] != 1 else ''}"
        if len(shape) == 1
        else f"a {' x '.join(map(str, shape))} mesh" + (f" ({' x '.join(names)})" if names else "")
    )
    placements = list(sharding.get("parameters", {}).values())
    reshard = [m.get("reshard_after_forward") for m in modules.values() if m.get("reshard_after_forward") is not None]
    reshard_words = _tally(["yes" if r is True else "no" if r is False else f"to {r} ranks" for r in reshard])
    return (
        f"It was sharded by torch FSDP2 (fully_shard) on {where} in {len(modules)} "
        f"module{'s' if len(modules) != 1 else ''}: parameters placed {_tally(placements, 'parameters') or 'nowhere'}; "
        f"reshard after forward: {reshard_words or 'n/a'}; "
        f"{_tally([_precision(m.get('mixed_precision')) for m in modules.values()])}."
    )
