"""``adopt``: bring a DCP checkpoint written by another tool under lineage, in place.

Note: what adoption can and cannot prove. A save hashes each file while writing it, so its
manifest says "these are the bytes that were written". An adopted checkpoint was written by
someone else (``torch.distributed.checkpoint.save`` called directly, another trainer's
checkpointer); its files are hashed when it is adopted, so its manifest says only "these are the
bytes that were there when it was adopted". The manifest's ``adopted`` section and the ledger
row's ``detail.adopted`` say so, in those words, and ``shardline inspect``, ``lineage`` and
``report`` repeat it. From then on it verifies, loads, consolidates and signs like any checkpoint.

The steps (one process; nothing is written until every check passed):

1. Refuse a location that is not a directory (prefix), one that already has a ``manifest.json``
   (already under lineage) or a file named like a commit record, one without ``.metadata`` (not a
   DCP checkpoint, or a save that never finished), and one holding subdirectories.
2. Read ``.metadata`` (unpickled with DCP's allowlist, never running code) and check every
   storage location it records against the listing: each file present and long enough for the
   chunk at its offset and length; every tensor chunk and byte item has a location.
3. Hash every file (files ``.metadata`` does not name too: nothing in an adopted directory is left
   unverified; they are reported as extra files).
4. Write ``manifest.sha256``, ``SHA256SUMS`` and, last, ``manifest.json`` through the store
   (:meth:`~.CheckpointStore.commit_in_place`): nothing of the user's is moved or rewritten.
5. Append a commit row marked adopted to the ledger (:func:`~.records.record_adoption`).

What the metadata does not tell is marked unknown rather than guessed: the sharding units and
mixed precision, the training config and data, the parent; the world size is inferred from the
data file names (``__RANK_N.distcp``, DCP's own naming) and left 0 when they do not follow it.
No provenance statement is written: its claims (the code version, the runtime) would be this
process's, not those of the code that wrote the files.

``subfolders=True`` takes a directory whose DCP checkpoints are in its subfolders, beside loose
files -- a Hugging Face Trainer's ``checkpoint-N`` under Accelerate's FSDP: ``pytorch_model_fsdp_0/``
and ``optimizer_0/`` (each with its own ``.metadata``), ``trainer_state.json``, ``scheduler.pt``,
``rng_state_R.pth``. The same steps run on each subfolder (every one must be a finished DCP
checkpoint, holding no folder of its own); every file is hashed into the one manifest, listed by
its path below the directory (``optimizer_0/__0_0.distcp``), the loose files as extra files.
"""

from __future__ import annotations

import datetime
import os
import re
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata

from shardline._version import __version__
from shardline.checkpoint.coordination.parallelism import available_cores
from shardline.checkpoint.format.canonical import canonical_json, sha256_hex
from shardline.checkpoint.format.dcp_io import (
    CONFIG_KEY,
    MODEL_KEY,
    OPTIM_KEY,
    PER_RANK_KEY,
    TRAINER_KEY,
    key_paths,
    unpickle_metadata,
)
from shardline.checkpoint.integrity.hashing import FileDigest, sha256_file
from shardline.checkpoint.integrity.manifest import (
    DCP_METADATA,
    DERIVED_FILES,
    MANIFEST,
    MANIFEST_HASH_FILE,
    SUMS_FILE,
    build_manifest,
    read_checkpoint_file,
    render_manifest_hash_file,
    render_sums,
)
from shardline.checkpoint.integrity.verify import check_expected_hash
from shardline.checkpoint.provenance.directory import CHECKPOINTS_DIR, step_of
from shardline.checkpoint.provenance.ledger import LEDGER_NAME, Ledger
from shardline.checkpoint.provenance.records import record_adoption
from shardline.checkpoint.provenance.run_tags import check_run_tags
from shardline.checkpoint.storage.protocol import CHECKPOINT_NAME, CommitRecord, Location
from shardline.checkpoint.storage.stores import describe, local_path, locate, store_for
from shardline.errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    ConfigurationError,
    IntegrityError,
    PublishError,
)

__all__ = ["ADOPTED_HASHES", "AdoptedCheckpoint", "adopt"]

ADOPTED_HASHES = (
    "taken after the fact: the files were written by another tool and hashed when they were adopted, not while "
    "they were written; they show that nothing changed since the adoption, not what that tool wrote"
)
"""What an adopted checkpoint's hashes prove, in the words its manifest and ledger row record."""
_UNKNOWN = ("units", "mixed_precision", "config", "data_fingerprint", "parent")
_RANK_FILE = re.compile(r"^__(\d+)_(\d+)\.distcp$")
_TRAINER_NAME = re.compile(r"^checkpoint-(\d+)$")  # a Hugging Face Trainer's checkpoint-N
_SHOW = 8
_ACCELERATE_OPTIM_KEY = "optimizer"  # the key Accelerate's FSDP save puts the optimizer state under


@dataclass(frozen=True)
class AdoptedCheckpoint:
    """A checkpoint brought under lineage by :func:`adopt`."""

    path: Location
    step: int
    tag: str | None
    manifest_hash: str
    world_size: int
    """Inferred from the data file names (``__RANK_N.distcp``); 0 where they do not tell."""
    files: int
    total_bytes: int
    extra_files: tuple[str, ...]
    """Files that ``.metadata`` does not name: hashed and listed too, so nothing in the directory is unverified."""
    ledger: Path | None
    """The ledger that records it."""
    parent_manifest_hash: str | None = None


def _refuse_early(root: Location, *, subfolders: bool) -> tuple[dict[str, int], list[str]]:
    """Step 1: ``{path: size}`` of the files at ``root`` (paths below it, ``/``-separated) and the folders holding
    DCP checkpoints (``""`` for ``root`` itself), or the refusal naming what is wrong."""
    where = describe(root)
    if not root.is_dir():
        raise CheckpointNotFoundError(f"cannot adopt {where}: {store_for(root).absent}")
    children: list[Location] = sorted(root.iterdir(), key=lambda c: c.name)
    names = {c.name for c in children}
    if MANIFEST in names:
        raise CheckpointExistsError(
            f"{where} already has a {MANIFEST}: it is under lineage already (written by a shardline save, or "
            f"adopted before). Check it with `shardline verify {root}`; nothing was written."
        )
    taken = sorted(names & set(DERIVED_FILES))
    if taken:
        raise CheckpointExistsError(
            f"cannot adopt {where}: it holds {', '.join(taken)} but no {MANIFEST}, and adopting writes those names "
            "(left by an adoption that was interrupted, or files of your own). Move them out of the directory, "
            "then adopt again; nothing was written."
        )
    folders = [c for c in children if c.is_dir()]
    sizes = {c.name: int(c.stat().st_size) for c in children if not c.is_dir()}
    if not subfolders:
        dcp_folders = [f.name for f in folders if (f / DCP_METADATA).is_file()]
        hint = (
            f" Its subfolders {', '.join(dcp_folders[:_SHOW])} hold DCP checkpoints (a Trainer's checkpoint-N?): "
            "pass subfolders=True (--subfolders) to adopt them with the files beside them."
            if dcp_folders
            else ""
        )
        _require_metadata(where, names, hint)
        if folders:
            raise CheckpointError(
                f"cannot adopt {where}: it holds subdirectories ({', '.join(f.name for f in folders[:_SHOW])}), "
                "which a checkpoint's manifest cannot list; move them out, then adopt again (or, for a folder "
                "of DCP checkpoints such as a Trainer's checkpoint-N, pass subfolders=True / --subfolders); "
                "nothing was written."
            )
        return sizes, [""]
    if not folders:
        raise CheckpointNotFoundError(
            f"cannot adopt {where} with subfolders: it has no subfolder (contents: "
            f"{', '.join(sorted(names)[:_SHOW]) or 'empty'}); adopt a plain DCP directory without subfolders=True; "
            "nothing was written."
        )
    for folder in folders:
        inner: list[Location] = sorted(folder.iterdir(), key=lambda c: c.name)
        inside = {c.name for c in inner}
        held = sorted(inside & set(DERIVED_FILES))
        if held:
            raise CheckpointExistsError(
                f"cannot adopt {where}: its subfolder {folder.name} holds {', '.join(held)}"
                f" (a shardline checkpoint, or an interrupted adoption); check it with `shardline verify {folder}`; "
                "nothing was written."
            )
        _require_metadata(f"{where}'s subfolder {folder.name}", inside)
        deeper = [c.name for c in inner if c.is_dir()]
        if deeper:
            raise CheckpointError(
                f"cannot adopt {where}: its subfolder {folder.name} holds folders ({', '.join(deeper[:_SHOW])}); "
                "only one level of DCP subfolders is adopted; move them out; nothing was written."
            )
        sizes.update({f"{folder.name}/{c.name}": int(c.stat().st_size) for c in inner})
    return sizes, ([""] if DCP_METADATA in names else []) + [f.name for f in folders]


def _require_metadata(where: str, names: set[str], hint: str = "") -> None:
    if DCP_METADATA not in names:
        unfinished = (
            f" it has {DCP_METADATA}.tmp: a save that never finished;" if f"{DCP_METADATA}.tmp" in names else ""
        )
        shown = ", ".join(sorted(names)[:_SHOW]) or "empty"
        raise CheckpointNotFoundError(
            f"cannot adopt {where}: it has no {DCP_METADATA}, so it is not a finished torch.distributed.checkpoint "
            f"directory;{unfinished} contents: {shown}. Adopt the directory a completed dcp.save wrote; nothing "
            f"was written.{hint}"
        )


def _check_chunks(where: str, metadata: Metadata, sizes: Mapping[str, int]) -> set[str]:
    """Step 2: every chunk and item ``metadata`` records has its bytes in a file here; returns the files it names."""
    storage = metadata.storage_data
    if not isinstance(storage, dict) or not storage:
        raise IntegrityError(
            f"cannot adopt {where}: its {DCP_METADATA} records no storage locations (written by a storage writer "
            "that does not record them), so its chunks cannot be checked against the files; nothing was written"
        )
    problems: list[str] = []
    for index, info in storage.items():
        name, end = str(info.relative_path), int(info.offset) + int(info.length)
        if name not in sizes:
            problems.append(f"{name} (holding {index.fqn}) is missing")
        elif end > sizes[name]:
            problems.append(
                f"{name} is {sizes[name]} bytes but {index.fqn} is recorded at bytes {info.offset}..{end} (truncated)"
            )
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            lost = [list(c.offsets) for c in md.chunks if MetadataIndex(fqn, c.offsets) not in storage]
            if lost:
                problems.append(f"{fqn}: chunk(s) at offsets {lost[:3]} have no storage location")
        elif isinstance(md, BytesStorageMetadata) and MetadataIndex(fqn) not in storage:
            problems.append(f"{fqn}: the item has no storage location")
    if problems:
        more = f"; and {len(problems) - _SHOW} more" if len(problems) > _SHOW else ""
        raise IntegrityError(
            f"cannot adopt {where}: its files do not hold what its {DCP_METADATA} records -- "
            f"{'; '.join(problems[:_SHOW])}{more}. It is incomplete or damaged (a copy that stopped early?); "
            "copy it again from its source; nothing was written."
        )
    return {str(info.relative_path) for info in storage.values()}


def _hash_all(root: Location, sizes: Mapping[str, int], metadata_digests: Mapping[str, str]) -> list[FileDigest]:
    """Step 3: every file's SHA-256 (each ``.metadata``'s from the bytes that were unpickled)."""
    names = sorted(n for n in sizes if n not in metadata_digests)
    threads = max(1, min(len(names), available_cores()))
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="shardline-adopt") as pool:
        hashed = list(pool.map(lambda name: sha256_file(root / name), names))
    digests = [FileDigest(path=n, rank=0, bytes=sizes[n], sha256=d) for n, d in sorted(metadata_digests.items())]
    for name, (size, digest) in zip(names, hashed, strict=True):
        if size != sizes[name]:
            raise CheckpointError(
                f"cannot adopt {describe(root)}: {name} changed while it was being adopted ({sizes[name]} bytes "
                f"listed, {size} hashed); is something still writing there? Nothing was written."
            )
        match = _RANK_FILE.match(name.rpartition("/")[2])
        digests.append(FileDigest(path=name, rank=int(match[1]) if match else 0, bytes=size, sha256=digest))
    return digests


def _model_state(metadata: Metadata) -> dict[str, list[Any]]:
    """``{name: [shape, dtype]}`` of the model's tensors in ``metadata`` (under ``model``, else at the top)."""
    paths = key_paths(metadata)
    nested = MODEL_KEY in {p[0] for p in paths.values()}
    state: dict[str, list[Any]] = {}
    for key, path in paths.items():
        md = metadata.state_dict_metadata[key]
        if not isinstance(md, TensorStorageMetadata):
            continue
        if nested and len(path) == 2 and path[0] == MODEL_KEY:
            state[str(path[1])] = [list(md.size), str(md.properties.dtype).removeprefix("torch.")]
        elif not nested and len(path) == 1:
            state[str(path[0])] = [list(md.size), str(md.properties.dtype).removeprefix("torch.")]
    return state


def _describe_state(metadatas: Sequence[Metadata]) -> tuple[dict[str, Any], dict[str, bool]]:
    """The manifest's ``model`` (shapes and dtypes of the model's tensors) and ``contents``, from the metadata
    of each DCP folder adopted (a Trainer's checkpoint has one for the model and one for the optimizer)."""
    state: dict[str, list[Any]] = {}
    for metadata in metadatas:
        state.update(_model_state(metadata))
    numel = 0
    for shape, _ in state.values():
        n = 1
        for d in shape:
            n *= int(d)
        numel += n
    model = {
        "tensors": len(state),
        "parameters": numel,
        "parameters_note": "every tensor of the model state, buffers included (DCP metadata does not tell them apart)",
        "tied": [],
        "scalars": sorted(k for k, (shape, _) in state.items() if shape == []),
        "state": state,
    }

    tops: set[Any] = set()
    byte_tops: set[Any] = set()
    for metadata in metadatas:
        for key, path in key_paths(metadata).items():
            tops.add(path[0])
            if isinstance(metadata.state_dict_metadata[key], BytesStorageMetadata):
                byte_tops.add(path[0])
    contents = {
        "model": bool(state),
        "optimizer": OPTIM_KEY in tops or _ACCELERATE_OPTIM_KEY in tops,
        "trainer_state": TRAINER_KEY in byte_tops,
        "per_rank_state": PER_RANK_KEY in tops,
        "config": CONFIG_KEY in tops,
    }
    return model, contents


def _ledger_for(root: Location, ledger: Ledger | str | os.PathLike[str] | None) -> Ledger:
    if isinstance(ledger, Ledger):
        return ledger
    if ledger is not None:
        path = Path(ledger)
        return Ledger(path / LEDGER_NAME if path.is_dir() else path)
    local = local_path(root)
    if local is None:
        raise ConfigurationError(
            f"adopting {root} needs a ledger (ledger=RUN_DIR/lineage.sqlite, or --ledger): the lineage ledger is a "
            "SQLite file on this machine, and an object-store prefix holds none"
        )
    # Note: the ledgers that `shardline lineage RUN_DIR` finds: a run's (beside its checkpoints/ directory) when
    # there is one, else the one a CheckpointManager on the checkpoint's directory keeps beside its checkpoints.
    beside = local.parent / LEDGER_NAME
    run = local.parent.parent / LEDGER_NAME
    if not beside.is_file() and local.parent.name == CHECKPOINTS_DIR and run.is_file():
        return Ledger(run)
    return Ledger(beside)


def adopt(
    path: str | os.PathLike[str] | Location,
    *,
    step: int | None = None,
    ledger: Ledger | str | os.PathLike[str] | None = None,
    storage_options: Mapping[str, Any] | None = None,
    subfolders: bool = False,
    parent_manifest_hash: str | None = None,
    run_tags: Mapping[str, str] | None = None,
) -> AdoptedCheckpoint:
    """Bring the DCP checkpoint at ``path`` (written by another tool) under lineage, in place (see the module note).

    Args:
        path: A directory written by ``torch.distributed.checkpoint.save`` (or an ``s3://`` prefix holding one).
        step: The training step to record; default: from the name (``step-N``, ``step-N-TAG``, or a
            Trainer's ``checkpoint-N``).
        ledger: The ledger to record it in (a :class:`Ledger`, its file, or a run directory holding
            ``lineage.sqlite``); default for a local directory: ``lineage.sqlite`` beside it, where a
            ``CheckpointManager`` on its parent keeps its ledger -- or, for ``RUN/checkpoints/step-N``
            without one there, ``RUN/lineage.sqlite`` if it exists (a training run's). Required for an
            object-store prefix.
        storage_options: Options of the fsspec file system of a URL ``path`` (default: the AWS environment).
        subfolders: ``path`` holds its DCP checkpoints in subfolders, beside loose files (a Hugging
            Face Trainer's ``checkpoint-N`` under FSDP); see the module note.
        parent_manifest_hash: The manifest hash of the checkpoint this one continues (recorded as
            its parent in the manifest and the ledger row); default: unknown.
        run_tags: ``{key: value}`` strings the run is filed under (ticket, owner...), recorded in the manifest.

    Returns:
        The adopted checkpoint; its manifest and ledger row say its hashes were taken after the fact.

    Raises:
        CheckpointExistsError: it already has a ``manifest.json`` (or a file named like a commit record).
        CheckpointNotFoundError: no such directory, or no ``.metadata`` (not a finished DCP checkpoint;
            with ``subfolders``: a subfolder without one, or no subfolder).
        IntegrityError: a file ``.metadata`` names is missing or shorter than its chunks need.
        ConfigurationError: no step given and none in the name; no ledger for an object-store prefix;
            a ``parent_manifest_hash`` that is not a SHA-256 in hex; a bad run tag.
        LineageError: the ledger cannot be read.
        PublishError: it was committed, but its ledger row could not be written (``info`` is the checkpoint).
        Nothing is written when any error but the last is raised.
    """
    parent_manifest_hash = check_expected_hash(parent_manifest_hash, where="parent_manifest_hash")
    tags = check_run_tags(run_tags, where="run_tags")
    root = locate(path, storage_options=storage_options).absolute()
    store = store_for(root)
    store.check_access(root)
    where = describe(root)
    match = CHECKPOINT_NAME.match(root.name)
    trainer_name = _TRAINER_NAME.match(root.name)
    step = step if step is not None else (int(trainer_name[1]) if trainer_name else step_of(root.name))
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ConfigurationError(
            f"cannot adopt {where}: its name does not say the training step (step-N) and none was given "
            f"(got {step!r}); pass step=N (--step N)"
        )
    tag = match["tag"] if match else None
    book = _ledger_for(root, ledger)
    if not book.path.parent.is_dir():
        raise ConfigurationError(
            f"cannot record the adoption of {where} in {book.path}: no such directory {book.path.parent}; pass an "
            "existing run directory or ledger file; nothing was written"
        )
    if book.path.is_file():
        book.rows()  # a ledger that cannot be read fails here, before anything is written
    sizes, folders = _refuse_early(store.snapshot(root), subfolders=subfolders)
    named: set[str] = set()
    metadatas: list[Metadata] = []
    metadata_digests: dict[str, str] = {}
    for folder in folders:  # step 2, for each DCP checkpoint ("": the directory itself)
        prefix = f"{folder}/" if folder else ""
        meta_path = prefix + DCP_METADATA
        raw = read_checkpoint_file(root / meta_path)
        sizes[meta_path] = len(raw)
        metadata_digests[meta_path] = sha256_hex(raw)
        metadatas.append(unpickle_metadata(raw, root / meta_path))
        inside = {n.removeprefix(prefix): size for n, size in sizes.items() if n.startswith(prefix)}
        if not folder:
            inside = {n: size for n, size in inside.items() if "/" not in n}
        where_dcp = f"{where}'s subfolder {folder}" if folder else where
        named |= {prefix + n for n in _check_chunks(where_dcp, metadatas[-1], inside)}
    digests = _hash_all(root, sizes, metadata_digests)
    ranks = [_RANK_FILE.match(name.rpartition("/")[2]) for name in sizes]
    world_size = max(int(m[1]) for m in ranks if m) + 1 if ranks and any(ranks) else 0
    created = datetime.datetime.now(datetime.timezone.utc)
    model, contents = _describe_state(metadatas)
    extra = tuple(sorted(set(sizes) - named - set(metadata_digests)))
    unknown = [u for u in _UNKNOWN if not (u == "parent" and parent_manifest_hash)]
    manifest = build_manifest(
        step=step,
        tag=tag,
        kind="sharded",
        world_size=world_size,
        units=[],
        model_info=model,
        contents=contents,
        config_sha256=None,
        data_fingerprint=None,
        parent_manifest_sha256=parent_manifest_hash,
        files=digests,
        created=created,
        run_tags=tags,
    )
    manifest["adopted"] = {
        "at": manifest["created_at"],
        "by": f"shardline {__version__}",
        "hashes": ADOPTED_HASHES,
        "unknown": unknown,
        "world_size": "inferred from the data file names (__RANK_N.distcp)" if world_size else "unknown",
        "versions": "of the process that adopted it; DCP metadata does not record those of the writer",
        "extra_files": list(extra),
    }
    data = canonical_json(manifest)
    digest = sha256_hex(data)
    records = [
        CommitRecord(MANIFEST_HASH_FILE, render_manifest_hash_file(digest)),
        CommitRecord(SUMS_FILE, render_sums(digest, [d.to_json() for d in digests])),
        CommitRecord(MANIFEST, data),  # the commit record: last
    ]
    store.commit_in_place(root, records=records)
    adopted = AdoptedCheckpoint(
        path=root,
        step=step,
        tag=tag,
        manifest_hash=digest,
        world_size=world_size,
        files=len(digests),
        total_bytes=sum(d.bytes for d in digests),
        extra_files=extra,
        ledger=book.path,
        parent_manifest_hash=parent_manifest_hash,
    )
    try:
        record_adoption(book, adopted, at=manifest["created_at"], hashes=ADOPTED_HASHES)
    except Exception as e:
        raise PublishError(
            f"{where} is adopted (manifest {digest[:12]} written), but recording it in the ledger {book.path} failed "
            f"({type(e).__name__}: {e}). Fix the cause; a CheckpointManager on its directory records it (marked "
            "recovered) when it opens.",
            info=adopted,
        ) from e
    return adopted
