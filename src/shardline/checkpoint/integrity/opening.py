"""Open a checkpoint for reading: nothing in it is used before it is checked against its manifest.

Note: the order, for every reader (``load``, resume, ``consolidate``, ``load_config``, the
training launcher's compatibility check).

1. **The manifest is anchored**: ``manifest.json`` must be the canonical JSON of a shardline
   manifest, and its hash must equal the hash the caller trusts -- ``--expect``, the ledger row
   of that checkpoint -- or, when the caller has none, the one ``manifest.sha256`` records
   (which only detects accidents: whoever can rewrite the directory can rewrite both).
2. **The listing** (levels ``full`` and ``sizes``): every listed file present with its recorded
   size, ``manifest.sha256`` and ``SHA256SUMS`` as the manifest implies them, nothing else there.
3. **``.metadata``** (every level, whenever there is a manifest): its bytes are hashed and
   compared with the manifest *before* they are unpickled, and the unpickling admits only the
   classes DCP metadata holds (``dcp_io.unpickle_metadata``), so it cannot run code either way.
4. **The data files** (level ``full``): every byte hashed -- by ``load`` while it reads them,
   each rank a disjoint share, all ranks agreeing before any value is used (``reading.py``);
   by the offline readers here, before they read (:func:`open_checkpoint`).

A plain DCP directory (no manifest) cannot be checked: it opens only at level ``none``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from shardline.checkpoint.format.canonical import canonical_json, sha256_hex
from shardline.checkpoint.format.dcp_io import MetadataReader, unpickle_metadata
from shardline.checkpoint.format.packed_view import logical_metadata
from shardline.checkpoint.integrity.manifest import (
    DCP_METADATA,
    FORMAT,
    MANIFEST,
    MANIFEST_HASH_FILE,
    manifest_files,
    read_checkpoint_file,
)
from shardline.checkpoint.integrity.reading import VerifyingReader
from shardline.checkpoint.integrity.verify import (
    FileProblem,
    VerifyLevel,
    check_expected_hash,
    check_files,
    derived_and_unexpected,
    level_argument,
)
from shardline.checkpoint.storage.fsutil import is_tmp_name
from shardline.checkpoint.storage.protocol import Location
from shardline.checkpoint.storage.stores import locate, store_for
from shardline.errors import CheckpointError, CheckpointNotFoundError, IntegrityError

__all__ = [
    "CheckedManifest",
    "OpenedCheckpoint",
    "check_manifest",
    "integrity_error",
    "open_checkpoint",
    "read_checked_metadata",
]

_SHOW = 5


@dataclass(frozen=True)
class CheckedManifest:
    """Steps 1-2 passed: the manifest (None for a plain DCP directory), its hash and what anchored it."""

    path: Location
    manifest: dict[str, Any] | None
    manifest_hash: str | None
    anchor: str
    level: VerifyLevel

    def entries(self) -> list[dict[str, Any]]:
        """The manifest's ``files`` entries (empty for a plain DCP directory)."""
        return manifest_files(self.manifest) if self.manifest is not None else []

    def data_entries(self) -> list[dict[str, Any]]:
        """The data files (everything listed but ``.metadata``)."""
        return [e for e in self.entries() if e["path"] != DCP_METADATA]

    def to_json(self, *, whole: bool = True) -> dict[str, Any]:
        """Plain data, to send to other ranks; ``whole=False``: of the manifest, only the ``files`` entries of
        ``.metadata`` (what a load's other ranks check against the manifest before their plan step).

        Note: what a load's other ranks use of the manifest is ``.metadata``'s entry (they hash
        ``.metadata`` before unpickling it; a nested ``.metadata``'s names an adopted folder's
        layout in the error) and the entries of the data files each hashes -- and those reach each
        rank in its DCP load plan, the coordinator's assignment (``reading.py``). The rest -- every
        other rank's file entries (17 MB at 16,384 ranks x 8 files), the model's units, the config,
        the provenance -- is not sent. The hash of the whole manifest travels with it, as before.
        """
        manifest = self.manifest
        if manifest is not None and not whole:
            manifest = {"files": [e for e in manifest_files(manifest) if _is_dcp_metadata(str(e["path"]))]}
        return {
            "path": str(self.path),
            "manifest": manifest,
            "manifest_hash": self.manifest_hash,
            "anchor": self.anchor,
            "level": self.level.value,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CheckedManifest:
        return cls(
            locate(data["path"]),
            data["manifest"],
            data["manifest_hash"],
            data["anchor"],
            VerifyLevel(data["level"]),
        )


def _is_dcp_metadata(name: str) -> bool:
    return name == DCP_METADATA or name.endswith(f"/{DCP_METADATA}")


def integrity_error(path: Location, problems: list[FileProblem], *, what: str = "it was not loaded") -> IntegrityError:
    """One error naming the first files that do not match (file first, then what is wrong)."""
    listing = "; ".join(f"{p.path}: {p.kind} ({p.detail})" for p in problems[:_SHOW])
    more = f"; and {len(problems) - _SHOW} more" if len(problems) > _SHOW else ""
    return IntegrityError(
        f"checkpoint {path} does not match its manifest -- {listing}{more}; {what}. Run `shardline verify {path}` "
        "for a full report."
    )


def _contents(path: Location) -> str:
    return ", ".join(sorted(p.name for p in path.iterdir())[:8]) or "empty"


def _anchor(path: Location, expected: str | None) -> tuple[dict[str, Any], str, str, dict[str, bytes]]:
    """``(manifest, its hash, what anchored it, the bytes of the derived records read on the way)``."""
    file = path / MANIFEST
    raw = read_checkpoint_file(file)
    digest = sha256_hex(raw)
    try:
        manifest = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise integrity_error(path, [FileProblem(MANIFEST, "altered", f"not valid UTF-8 JSON: {e}")]) from None
    try:
        canonical = isinstance(manifest, dict) and manifest.get("format") == FORMAT and canonical_json(manifest) == raw
    except Exception:
        canonical = False
    if not canonical:
        raise integrity_error(
            path, [FileProblem(MANIFEST, "altered", "not the canonical JSON of a shardline manifest")]
        )
    if expected is not None:
        if digest != expected:
            raise integrity_error(
                path, [FileProblem(MANIFEST, "altered", f"manifest hash {digest}, the trusted record says {expected}")]
            )
        return manifest, digest, "the trusted manifest hash", {}
    hash_file = b""
    try:
        hash_file = read_checkpoint_file(path / MANIFEST_HASH_FILE)
        parts = hash_file.decode("ascii").split()
    except (FileNotFoundError, UnicodeDecodeError):
        parts = []
    recorded = parts[0] if len(parts) == 2 and parts[1] == MANIFEST else None
    if recorded is None:
        raise integrity_error(
            path, [FileProblem(MANIFEST_HASH_FILE, "missing", "needed to check the manifest (no hash was passed in)")]
        )
    if recorded != digest:
        raise integrity_error(
            path, [FileProblem(MANIFEST, "altered", f"sha256 {digest}, {MANIFEST_HASH_FILE} records {recorded}")]
        )
    return manifest, digest, MANIFEST_HASH_FILE, {MANIFEST_HASH_FILE: hash_file}


def check_manifest(
    path: Location | str | os.PathLike[str],
    *,
    level: VerifyLevel | str = VerifyLevel.FULL,
    expected_manifest_hash: str | None = None,
) -> CheckedManifest:
    """Steps 1-2 of the module note (one process; ``load`` runs it on rank 0).

    Raises:
        CheckpointNotFoundError: not a directory, a save's temporary directory, or not a checkpoint.
        IntegrityError: the manifest does not verify, or a file is missing, altered (size) or unexpected.
        ConfigurationError: a bad level or expected hash.
    """
    level = VerifyLevel.parse(level)
    expected = check_expected_hash(expected_manifest_hash)
    path = locate(path)
    path = store_for(path).snapshot(path)  # in a store, one LIST answers every "present? what size?" below
    if not path.is_dir():
        raise CheckpointNotFoundError(f"{path} is not a checkpoint: no such directory")
    if is_tmp_name(path.name):
        raise CheckpointNotFoundError(
            f"{path} is the temporary directory of a save that never committed (interrupted or failed); it may be "
            "incomplete and must not be loaded. Load a committed checkpoint (a step-N directory) instead."
        )
    if not (path / MANIFEST).is_file():
        if not (path / DCP_METADATA).is_file():
            raise CheckpointNotFoundError(
                f"{path} is not a checkpoint: it has neither {MANIFEST} nor {DCP_METADATA} "
                f"(contents: {_contents(path)})"
            )
        if level is not VerifyLevel.NONE:
            raise IntegrityError(
                f"{path} is a plain torch.distributed.checkpoint directory without a shardline manifest, so nothing "
                f"in it can be verified (verify={level.value!r}); load it with verify='none' if you trust it (it has "
                "no lineage; its .metadata is still read without running code)"
            )
        return CheckedManifest(path, None, None, "none (no manifest)", level)
    manifest, digest, anchor, read = _anchor(path, expected)
    try:
        entries = manifest_files(manifest)
    except IntegrityError as e:
        raise integrity_error(path, [FileProblem(MANIFEST, "altered", str(e))]) from None
    if level is not VerifyLevel.NONE:
        problems, _ = check_files(path, entries, VerifyLevel.SIZES)
        problems += derived_and_unexpected(path, digest, entries, problems, read=read)
        if problems:
            raise integrity_error(path, problems)
    return CheckedManifest(path, manifest, digest, anchor, level)


def read_checked_metadata(checked: CheckedManifest) -> Metadata:
    """Step 3: ``.metadata``'s bytes hashed against the manifest, then unpickled with the DCP allowlist.

    A packed checkpoint's metadata comes back as its logical view (``packed_view.logical_metadata``: tensors by
    name and shape, its table checked against its segments), so every reader sees the same keys in either layout.

    Raises:
        IntegrityError: ``.metadata`` is missing, does not match its manifest entry (it is then
            never unpickled), or is not DCP metadata; or a packed layout table that does not match its segments.
    """
    file = checked.path / DCP_METADATA
    try:
        data = file.read_bytes()
    except FileNotFoundError:
        nested = [str(e["path"]) for e in checked.entries() if str(e["path"]).endswith(f"/{DCP_METADATA}")]
        if nested:  # not damage: a folder adopted with subfolders=True
            raise CheckpointError(
                f"{checked.path} holds its DCP checkpoints in subfolders ({', '.join(sorted(nested))}; a Trainer's "
                "checkpoint-N adopted with its files): load and consolidate read one DCP checkpoint at the top of "
                "a directory. Resume it with the Trainer that wrote it (LineageCallback verifies it first); "
                f"`shardline verify {checked.path}` checks it."
            ) from None
        raise integrity_error(checked.path, [FileProblem(DCP_METADATA, "missing", "the DCP metadata file")]) from None
    if checked.manifest is not None:
        entry = next((e for e in checked.entries() if e["path"] == DCP_METADATA), None)
        if entry is None:
            raise integrity_error(checked.path, [FileProblem(DCP_METADATA, "unexpected", "not listed in the manifest")])
        digest = sha256_hex(data)
        if len(data) != int(entry["bytes"]) or digest != entry["sha256"]:
            detail = f"sha256 {digest} ({len(data)} bytes), manifest records {entry['sha256']} ({entry['bytes']} bytes)"
            raise integrity_error(
                checked.path, [FileProblem(DCP_METADATA, "altered", detail)], what="it was not unpickled or loaded"
            )
    return logical_metadata(unpickle_metadata(data, file), where=checked.path)


@dataclass(frozen=True)
class OpenedCheckpoint:
    """A checkpoint checked at ``checked.level``, with its DCP metadata; :meth:`reader` reads it with DCP."""

    checked: CheckedManifest
    metadata: Metadata

    @property
    def path(self) -> Location:
        return self.checked.path

    def reader(self) -> MetadataReader:
        """A DCP storage reader over the (already checked) files, serving the checked metadata."""
        local = store_for(self.path).local_file(self.path)
        if local is None:  # DCP's own FileSystemReader reads local paths only
            return VerifyingReader(self.path, self.metadata, to_hash=())
        return MetadataReader(local, self.metadata)


def open_checkpoint(
    path: Location | str | os.PathLike[str],
    *,
    level: VerifyLevel | str = VerifyLevel.FULL,
    expected_manifest_hash: str | None = None,
    verify: VerifyLevel | str | None = None,
) -> OpenedCheckpoint:
    """Check a checkpoint in this process (steps 1-4: at ``full`` every data file is hashed first).

    For offline readers (``consolidate``, ``load_config``, the launcher); ``load`` spreads step
    4 over its ranks and hashes while reading instead. ``verify=`` is the deprecated name of ``level=``.

    Raises:
        CheckpointNotFoundError, IntegrityError: as :func:`check_manifest`; IntegrityError also
            for a data file whose SHA-256 differs from the manifest.
        ConfigurationError: an unknown level (the message lists the valid ones).
    """
    level = level_argument(level, verify, caller="open_checkpoint")
    checked = check_manifest(path, level=level, expected_manifest_hash=expected_manifest_hash)
    metadata = read_checked_metadata(checked)
    if checked.level is VerifyLevel.FULL:
        problems, _ = check_files(checked.path, checked.data_entries(), VerifyLevel.FULL)
        if problems:
            raise integrity_error(checked.path, problems, what="nothing was read from it")
    return OpenedCheckpoint(checked, metadata)
