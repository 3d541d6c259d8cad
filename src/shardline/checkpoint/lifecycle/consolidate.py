"""``consolidate``: a checkpoint's model weights as safetensors (one file, or HF-style shards + index).

Streams: shard files are planned from DCP's metadata (names, shapes, dtypes), each file's
header is written first, then tensors are read from the checkpoint a small batch at a time
(``torch.distributed.checkpoint.load`` of just those keys, no process group) and appended. Peak
memory is about one read batch (at most ``read_batch_bytes``, default 256 MiB, never more
than one output shard) plus the largest tensor twice (DCP's read buffer and the target) -- not
the model. Output files are hashed while written; ``consolidation.json`` records them with the
source checkpoint's manifest hash, and ``SHA256SUMS`` lets ``sha256sum -c`` check them.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re
import shutil
import uuid
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from shardline._version import __version__
from shardline.checkpoint.format.canonical import canonical_json, sha256_hex
from shardline.checkpoint.format.dcp_io import (
    CONFIG_KEY,
    MODEL_KEY,
    TRAINER_KEY,
    MetadataReader,
    decode_state,
    key_paths,
)
from shardline.checkpoint.format.hf_export import export_layout
from shardline.checkpoint.format.load_planner import ShardlineLoadPlanner
from shardline.checkpoint.format.safetensors_io import SafetensorsWriter, TensorSpec
from shardline.checkpoint.format.tokenizer_export import ExportedTokenizer, tokenizer_files
from shardline.checkpoint.integrity.opening import open_checkpoint
from shardline.checkpoint.integrity.verify import VerifyLevel
from shardline.checkpoint.storage.fsutil import fsync_dir
from shardline.checkpoint.storage.protocol import Location
from shardline.checkpoint.storage.stores import local_path, locate, store_for
from shardline.errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointWarning,
    ConfigurationError,
    StorageAccessError,
)

__all__ = ["SIDECAR", "ConsolidationResult", "consolidate", "parse_dtype", "parse_size", "strip_wrapper_prefixes"]

SIDECAR = "consolidation.json"
WRAPPER_SEGMENTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_DTYPES = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
}  # fmt: skip


def parse_size(text: str | int) -> int:
    """Bytes in ``"5GB"`` (decimal units, like Hugging Face), ``"512MiB"`` (binary) or a plain integer."""
    if isinstance(text, int):
        size = text
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
        unit = match[2].upper() if match else None
        if not match or unit not in _UNITS:
            raise ConfigurationError(f"cannot read the size {text!r}; write e.g. 5GB, 500MB, 2GiB or a number of bytes")
        size = int(float(match[1]) * _UNITS[unit])
    if size <= 0:
        raise ConfigurationError(f"the maximum shard size must be positive, got {text!r}")
    return size


def parse_dtype(text: str | torch.dtype) -> torch.dtype:
    """``bf16``/``fp16``/``fp32`` (and long names) as a torch dtype."""
    if isinstance(text, torch.dtype):
        return text
    dtype = _DTYPES.get(str(text).lower().removeprefix("torch."))
    if dtype is None:
        raise ConfigurationError(f"unknown dtype {text!r}; choose bf16, fp16 or fp32")
    return dtype


def strip_wrapper_prefixes(names: Sequence[str]) -> dict[str, str]:
    """``original -> exported`` name with wrapper segments (``_orig_mod.`` of torch.compile, activation
    checkpointing's ``_checkpoint_wrapped_module.``...) and a ``module.`` prefix shared by all names removed."""
    out = {}
    for name in names:
        parts = [p for p in name.split(".") if p not in WRAPPER_SEGMENTS]
        out[name] = ".".join(parts)
    if out and all(v.startswith("module.") for v in out.values()):
        out = {k: v.removeprefix("module.") for k, v in out.items()}
    seen: dict[str, str] = {}
    for original, new in out.items():
        if new in seen:
            raise ConfigurationError(
                f"{seen[new]!r} and {original!r} both export as {new!r} once wrapper prefixes are stripped"
            )
        seen[new] = original
    return out


@dataclass(frozen=True)
class ConsolidationResult:
    """What :func:`consolidate` wrote."""

    out: Path
    files: tuple[dict[str, Any], ...]
    tensors: int
    total_bytes: int
    source_manifest_hash: str | None
    step: int | None
    aliases: dict[str, str] = field(default_factory=dict)
    note: str | None = None
    verified: str = VerifyLevel.FULL.value
    """How the source was checked: ``full`` (every byte), or an opt-in (``sizes``, ``none``)."""


def _plan(specs: list[tuple[str, TensorSpec]], max_bytes: int | None) -> list[list[tuple[str, TensorSpec]]]:
    shards: list[list[tuple[str, TensorSpec]]] = [[]]
    size = 0
    for item in specs:
        nbytes = item[1].nbytes
        if max_bytes is not None and shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += nbytes
    return shards


def _read_batch(
    reader: MetadataReader, flat: bool, batch: list[tuple[str, TensorStorageMetadata]]
) -> dict[str, torch.Tensor]:
    tensors = {key: torch.empty(tuple(md.size), dtype=md.properties.dtype) for key, md in batch}
    targets: dict[str, Any] = dict(tensors) if flat else {MODEL_KEY: tensors}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.load(targets, storage_reader=reader, planner=ShardlineLoadPlanner(), no_dist=True)
    return tensors


def consolidate(
    checkpoint: str | os.PathLike[str] | Location,
    out: str | os.PathLike[str],
    *,
    max_shard_size: str | int | None = None,
    dtype: str | torch.dtype | None = None,
    verify: VerifyLevel | str = VerifyLevel.FULL,
    expected_manifest_hash: str | None = None,
    read_batch_bytes: int = 256 * 2**20,
    adapters: bool = False,
    storage_options: Mapping[str, Any] | None = None,
) -> ConsolidationResult:
    """Export the model weights of ``checkpoint`` as safetensors: one file, or a new directory ``out``.

    ``out`` ending in ``.safetensors`` (and no ``max_shard_size``): that one file, with the source
    manifest hash and step in its safetensors metadata. Otherwise a directory: one
    ``model.safetensors`` when everything fits in ``max_shard_size`` (or none is given), else
    ``model-0000i-of-0000n.safetensors`` shards with ``model.safetensors.index.json``, beside a
    ``consolidation.json`` sidecar and ``SHA256SUMS``. Tied parameters are written once (under
    their first name; the others are listed as aliases in the sidecar), 0-d parameters get
    their shape back, wrapper prefixes are stripped, floating-point tensors are cast to
    ``dtype`` if given. A checkpoint of a transformers model (its config is recorded at save)
    gets ``config.json`` and ``generation_config.json``, so ``from_pretrained(out)`` loads it;
    of a PEFT model, the base model is written that way, and ``adapters=True`` writes the
    adapter instead (``adapter_model.safetensors`` + ``adapter_config.json`` for
    ``PeftModel.from_pretrained``). See :mod:`shardline.checkpoint.format.hf_export`. A checkpoint
    saved by ``shardline train`` also gets the tokenizer the run trained with (``data.tokenizer``;
    for bytes, a ``tokenizers`` file that encodes the same), so ``AutoTokenizer.from_pretrained(out)``
    works: :mod:`shardline.checkpoint.format.tokenizer_export`.

    Args:
        verify: ``"full"`` (default: every file hashed against the manifest before anything is
            read), or the opt-ins ``"sizes"`` and ``"none"`` (the only way to export a plain DCP
            directory); an opt-in is recorded in ``consolidation.json`` and warned about.
        expected_manifest_hash: The manifest hash to trust (e.g. from the ledger); default:
            the one ``manifest.sha256`` records.
        adapters: Export the PEFT adapter (a directory) instead of the model.
        storage_options: For a ``checkpoint`` URL: options of its fsspec file system (endpoint,
            credentials; default: the standard AWS environment).

    Raises:
        IntegrityError: the checkpoint fails verification (naming the files); nothing is written.
        CheckpointExistsError: ``out`` exists (a directory may exist if empty).
        CheckpointError: ``out`` cannot be created.
        ConfigurationError: ``adapters`` for a checkpoint without a PEFT adapter shardline exports.
        StorageAccessError: ``out`` is an object-store URL, or the source's bucket cannot be used.
    """
    dst = local_path(out)
    if dst is None:
        # Path("s3://b/x") would be a local directory named "s3:"; the export is written locally, then uploaded.
        raise StorageAccessError(
            f"consolidate writes a local file or directory, and {out} is an object-store URL: write it to a local "
            f"path, then upload it (e.g. `aws s3 cp --recursive OUT {out}`); the source checkpoint may be a URL"
        )
    src = locate(checkpoint, storage_options=storage_options)  # a local directory or an object-store URL
    store_for(src).check_access(src)
    dst = dst.absolute()
    max_bytes = parse_size(max_shard_size) if max_shard_size is not None else None
    cast = parse_dtype(dtype) if dtype is not None else None
    single_file = dst.suffix == ".safetensors" and max_bytes is None
    if adapters and (single_file or max_bytes is not None):
        raise ConfigurationError(
            "--adapters writes a folder (adapter_model.safetensors + adapter_config.json, one file of weights): "
            "give a directory as the output and no --max-shard-size"
        )
    if single_file and (dst.exists() or dst.is_symlink()):
        raise CheckpointExistsError(f"{dst} already exists; choose a new output file (exports never overwrite)")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise CheckpointExistsError(f"{dst} already exists and is not an empty directory; choose a new output path")
    opened = open_checkpoint(src, level=verify, expected_manifest_hash=expected_manifest_hash)
    manifest, digest, level = opened.checked.manifest, opened.checked.manifest_hash, opened.checked.level
    if level.opt_in:
        unverified = "it has no shardline manifest" if manifest is None else "its data files were not hashed"
        warnings.warn(
            f"exporting {src} with verify={level.value!r}: {unverified}, so damaged bytes would go unnoticed; "
            "consolidation.json records this",
            CheckpointWarning,
            stacklevel=2,
        )
    reader = opened.reader()
    metadata = opened.metadata
    paths = key_paths(metadata)
    flat = not any(p[0] == MODEL_KEY for p in paths.values())
    stored: list[tuple[str, TensorStorageMetadata]] = []
    for key, path in paths.items():
        md = metadata.state_dict_metadata[key]
        if not isinstance(md, TensorStorageMetadata):
            continue
        if flat and len(path) == 1:
            stored.append((path[0], md))
        elif not flat and len(path) == 2 and path[0] == MODEL_KEY:
            stored.append((path[1], md))
    if not stored:
        raise ConfigurationError(f"{src} holds no model tensors to export")
    model_info = (manifest or {}).get("model", {})
    tied = {alias: group[0] for group in model_info.get("tied", []) for alias in group[1:]}
    scalars = set(model_info.get("scalars", []))
    state = _trainer_state(reader, metadata) if (manifest or {}).get("contents", {}).get("trainer_state") else {}
    layout = export_layout(strip_wrapper_prefixes([k for k, _ in stored]), state, adapters=adapters)
    tokenizer = ExportedTokenizer()
    if not single_file and not adapters and (manifest or {}).get("contents", {}).get("config"):
        tokenizer = tokenizer_files(_config(reader, metadata))
        if tokenizer.note:
            warnings.warn(f"exporting {src}: {tokenizer.note}", CheckpointWarning, stacklevel=2)
    note = "; ".join(n for n in (layout.note, tokenizer.note) if n) or None
    names = layout.names
    # Tied names as exported: an alias is reported when both it and its target are part of this export.
    aliases = {names[a]: names[t] for a, t in tied.items() if a in names and t in names}
    specs: list[tuple[str, TensorSpec]] = []
    sources: dict[str, TensorStorageMetadata] = {}
    for key, md in stored:
        if key in tied or key not in names:
            continue
        shape = () if key in scalars else tuple(md.size)
        out_dtype = cast if cast is not None and md.properties.dtype.is_floating_point else md.properties.dtype
        specs.append((key, TensorSpec(names[key], shape, out_dtype)))
        sources[key] = md
    shards = _plan(specs, max_bytes)
    tmp = dst.parent / f".{dst.name}.tmp-{uuid.uuid4().hex[:12]}"
    try:
        tmp.mkdir(parents=True)
    except OSError as e:
        raise CheckpointError(
            f"cannot create the output directory {dst.parent if single_file else dst}: {e.strerror or e}. "
            "Choose a writable location."
        ) from None
    step = (manifest or {}).get("step")
    batch_bytes = min(read_batch_bytes, max_bytes or read_batch_bytes)
    if single_file:
        provenance = {"shardline_source_manifest_sha256": digest or "", "shardline_step": str(step)}
        result = _write_single_file(
            reader, flat, specs, sources, tmp, dst, batch_bytes, provenance, aliases, layout.note
        )
        return dataclasses.replace(result, verified=level.value)
    try:
        files = _write_shards(reader, flat, shards, sources, tmp, batch_bytes, layout.weights_name)
        extra: dict[str, bytes] = {}
        if len(shards) > 1:
            weight_map = {spec.name: f["path"] for shard, f in zip(shards, files, strict=True) for _, spec in shard}
            total = sum(spec.nbytes for _, spec in specs)
            extra[f"{layout.weights_name}.safetensors.index.json"] = (
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n"
            ).encode()
        extra.update(layout.extra_files)
        extra.update({k: v for k, v in tokenizer.files.items() if k not in extra})
        for name, data in extra.items():
            (tmp / name).write_bytes(data)
            files.append({"path": name, "bytes": len(data), "sha256": sha256_hex(data)})
        sidecar: dict[str, Any] = {
            "format": "shardline.consolidation",
            "format_version": 1,
            "created_at": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
            "source": {
                "checkpoint": str(src.absolute()),
                "manifest_sha256": digest,
                "step": (manifest or {}).get("step"),
                "verified": level.value,
            },
            "dtype": str(cast).removeprefix("torch.") if cast is not None else None,
            "max_shard_size_bytes": max_bytes,
            "tensors": len(specs),
            "aliases": aliases,
            "renamed": {k: v for k, v in names.items() if k != v},
            "shardline_version": __version__,
            "files": sorted(files, key=lambda f: f["path"]),
            **({"adapters": True} if adapters else {}),
        }
        side = canonical_json(sidecar)
        (tmp / SIDECAR).write_bytes(side)
        rows = {f["path"]: f["sha256"] for f in files} | {SIDECAR: sha256_hex(side)}
        (tmp / "SHA256SUMS").write_text("".join(f"{h}  {n}\n" for n, h in sorted(rows.items())))
        fsync_dir(tmp)
        if dst.exists():
            dst.rmdir()
        os.rename(tmp, dst)
        fsync_dir(dst.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ConsolidationResult(
        out=dst,
        files=tuple(sidecar["files"]),
        tensors=len(specs),
        total_bytes=sum(f["bytes"] for f in files),
        source_manifest_hash=digest,
        step=step,
        aliases=aliases,
        note=note,
        verified=level.value,
    )


def _write_single_file(
    reader: MetadataReader,
    flat: bool,
    specs: list[tuple[str, TensorSpec]],
    sources: dict[str, TensorStorageMetadata],
    tmp: Path,
    dst: Path,
    batch_bytes: int,
    provenance: dict[str, str],
    aliases: dict[str, str],
    note: str | None,
) -> ConsolidationResult:
    """Write every tensor into ``dst`` (one ``.safetensors`` file, provenance in its metadata), atomically."""
    try:
        (entry,) = _write_shards(reader, flat, [specs], sources, tmp, batch_bytes, "model", provenance)
        if dst.exists() or dst.is_symlink():
            raise CheckpointExistsError(f"{dst} appeared while the export was being written; it was left untouched")
        os.rename(tmp / entry["path"], dst)
        fsync_dir(dst.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return ConsolidationResult(
        out=dst,
        files=({**entry, "path": dst.name},),
        tensors=len(specs),
        total_bytes=entry["bytes"],
        source_manifest_hash=provenance["shardline_source_manifest_sha256"] or None,
        step=int(provenance["shardline_step"]) if provenance["shardline_step"].isdigit() else None,
        aliases=aliases,
        note=note,
    )


def _trainer_state(reader: MetadataReader, metadata: Metadata) -> dict[str, Any]:
    if TRAINER_KEY not in key_paths(metadata):
        return {}
    target: dict[str, Any] = {TRAINER_KEY: None}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.load(target, storage_reader=reader, planner=ShardlineLoadPlanner(), no_dist=True)
    state: dict[str, Any] = decode_state(target[TRAINER_KEY])  # a trainer state is saved as a dict
    return state


def _config(reader: MetadataReader, metadata: Metadata) -> dict[str, Any] | None:
    """The training config the checkpoint records (None without one, or one that is not a JSON object)."""
    if CONFIG_KEY not in key_paths(metadata):
        return None
    target: dict[str, Any] = {CONFIG_KEY: None}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.load(target, storage_reader=reader, planner=ShardlineLoadPlanner(), no_dist=True)
    try:
        config = json.loads(target[CONFIG_KEY])
    except (TypeError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def _write_shards(
    reader: MetadataReader,
    flat: bool,
    shards: list[list[tuple[str, TensorSpec]]],
    sources: dict[str, TensorStorageMetadata],
    tmp: Path,
    batch_bytes: int,
    weights_name: str,
    provenance: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    files = []
    n = len(shards)
    for i, shard in enumerate(shards):
        name = f"{weights_name}.safetensors" if n == 1 else f"{weights_name}-{i + 1:05d}-of-{n:05d}.safetensors"
        metadata = {"format": "pt", **(provenance or {})}
        writer = SafetensorsWriter(tmp / name, [spec for _, spec in shard], metadata=metadata)
        j = 0
        while j < len(shard):
            batch: list[tuple[str, TensorSpec]] = []
            size = 0
            while j < len(shard) and (not batch or size + shard[j][1].nbytes <= batch_bytes):
                batch.append(shard[j])
                size += shard[j][1].nbytes
                j += 1
            loaded = _read_batch(reader, flat, [(key, sources[key]) for key, _ in batch])
            for key, spec in batch:
                tensor = loaded.pop(key)
                writer.write(tensor.reshape(spec.shape).to(spec.dtype))
                del tensor
        files.append({"path": name, "bytes": writer.bytes, "sha256": writer.close()})
    return files
