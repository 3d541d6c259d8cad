"""What an experiment tracker is told about one committed checkpoint: its manifest, turned into
the shapes a tracker's UI shows.

:func:`tracker_record` reads a committed checkpoint's manifest (checked against
``manifest.sha256``) and returns a :class:`TrackerRecord`: the manifest's exact bytes (logged as
an artifact, so ``sha256sum`` of the downloaded file prints the manifest hash), the sharding
configuration and the lineage parent as flat ``checkpoint/step-N/...`` keys (MLflow tags, W&B
summary entries), the file table (rank, path, bytes, SHA-256) as columns (MLflow ``log_table``,
``wandb.Table``) and as a markdown table (TensorBoard's text tab), and the run tags the
checkpoint recorded. Each tracker adapter (``shardline.train.trackers``, the TensorBoard
callback) only hands these to its client.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from shardline.checkpoint.format.canonical import canonical_json
from shardline.checkpoint.integrity.manifest import manifest_files, read_manifest
from shardline.checkpoint.provenance.ledger import Ledger, LedgerRow
from shardline.checkpoint.provenance.run_tags import RUN_TAGS_KEY
from shardline.checkpoint.storage.protocol import Location
from shardline.checkpoint.storage.stores import locate
from shardline.errors import CheckpointError

__all__ = ["FILE_COLUMNS", "TrackerRecord", "committed_records", "tracker_record"]

log = logging.getLogger(__name__)

FILE_COLUMNS = ("rank", "path", "bytes", "sha256")
"""The columns of a checkpoint's file table, in order."""


@dataclass(frozen=True)
class TrackerRecord:
    """One committed checkpoint as a tracker records it (see the module docstring)."""

    name: str
    """The checkpoint directory's name (``step-100``, ``step-100-preempted``)."""
    path: str
    step: int
    manifest_sha256: str
    parent_manifest_sha256: str | None
    manifest_json: bytes
    """``manifest.json`` byte for byte (its SHA-256 is :attr:`manifest_sha256`)."""
    sharding: dict[str, str]
    """World size, mesh, strategy, state-dict kind and engine, as text."""
    files: tuple[tuple[int, str, int, str], ...]
    """``(rank, path, bytes, sha256)`` of every file the manifest lists, by path."""
    run_tags: dict[str, str] = field(default_factory=dict)

    @property
    def prefix(self) -> str:
        """``checkpoint/NAME``: where this checkpoint's keys and artifacts go in a tracker run."""
        return f"checkpoint/{self.name}"

    @property
    def total_bytes(self) -> int:
        return sum(f[2] for f in self.files)

    def flat(self) -> dict[str, str]:
        """``{"checkpoint/step-N/manifest_sha256": ..., ".../parent_manifest_sha256", ".../world_size", ...}``."""
        out = {
            f"{self.prefix}/manifest_sha256": self.manifest_sha256,
            f"{self.prefix}/parent_manifest_sha256": self.parent_manifest_sha256 or "none",
            f"{self.prefix}/step": str(self.step),
            f"{self.prefix}/files": str(len(self.files)),
            f"{self.prefix}/bytes": str(self.total_bytes),
        }
        out.update({f"{self.prefix}/{key}": value for key, value in self.sharding.items()})
        return out

    def columns(self) -> dict[str, list[Any]]:
        """The file table as ``{column: values}`` (what MLflow's ``log_table`` takes)."""
        return {name: [row[i] for row in self.files] for i, name in enumerate(FILE_COLUMNS)}

    def rows(self) -> list[list[Any]]:
        """The file table as rows in :data:`FILE_COLUMNS` order (what ``wandb.Table`` takes)."""
        return [list(row) for row in self.files]

    def markdown(self) -> str:
        """The whole record as markdown: a key/value table, then the file table (TensorBoard's text tab)."""
        head = [
            f"**{self.name}** manifest `{self.manifest_sha256}`",
            "",
            "| key | value |",
            "|---|---|",
            *(f"| {key.removeprefix(self.prefix + '/')} | `{value}` |" for key, value in self.flat().items()),
            *(f"| tag {key} | `{value}` |" for key, value in self.run_tags.items()),
            "",
            "| " + " | ".join(FILE_COLUMNS) + " |",
            "|---|---|---|---|",
        ]
        return "\n".join([*head, *(f"| {r} | {p} | {b} | `{s}` |" for r, p, b, s in self.files)]) + "\n"


def _text(value: Any) -> str:
    if isinstance(value, Mapping) and "shape" in value:  # the manifest's mesh: {"shape": [2, 4], "dim_names": [...]}
        shape = list(value["shape"])
        names = [*(value.get("dim_names") or []), *[""] * len(shape)][: len(shape)]
        return " x ".join(f"{n}={s}" if n else str(s) for s, n in zip(shape, names, strict=True))
    return str(value)


def _sharding(manifest: Mapping[str, Any]) -> dict[str, str]:
    strategies = manifest.get("strategies") or {}
    distinct = sorted({str(s) for s in strategies.values()}) if isinstance(strategies, Mapping) else []
    out = {
        "world_size": str(manifest.get("world_size")),
        "mesh": _text(manifest.get("mesh", "")),
        "strategy": "+".join(distinct) or "none",
        "state_dict_kind": str(manifest.get("state_dict_kind")),
    }
    sharding = manifest.get("sharding")
    if isinstance(sharding, Mapping) and "engine" in sharding:
        out["engine"] = str(sharding["engine"])
    return out


def tracker_record(path: str | os.PathLike[str] | Location) -> TrackerRecord:
    """The :class:`TrackerRecord` of the committed checkpoint at ``path`` (its manifest read and checked).

    Raises:
        CheckpointNotFoundError: ``path`` holds no committed checkpoint.
        IntegrityError: its manifest does not match ``manifest.sha256``.
    """
    location = locate(path)
    manifest, digest = read_manifest(location)
    files = tuple(
        sorted(
            ((int(f["rank"]), str(f["path"]), int(f["bytes"]), str(f["sha256"])) for f in manifest_files(manifest)),
            key=lambda f: f[1],
        )
    )
    tags = manifest.get(RUN_TAGS_KEY)
    return TrackerRecord(
        name=location.name,
        path=str(location),
        step=int(manifest["step"]),
        manifest_sha256=digest,
        parent_manifest_sha256=manifest.get("parent_manifest_sha256"),
        manifest_json=canonical_json(manifest),
        sharding=_sharding(manifest),
        files=files,
        run_tags={str(k): str(v) for k, v in tags.items()} if isinstance(tags, Mapping) else {},
    )


def committed_records(ledger: Ledger, rows: Iterable[LedgerRow]) -> list[TrackerRecord]:
    """The :class:`TrackerRecord` of each checkpoint of the commit ``rows`` still readable.

    One that retention already deleted, or that cannot be read, is left out with a warning (a tracker logs its
    hash from the ledger row all the same).
    """
    records = []
    for row in rows:
        try:
            records.append(tracker_record(ledger.locate(row.checkpoint)))
        except CheckpointError as e:
            log.warning("%s is not recorded in the tracker in full: %s", row.checkpoint, e)
    return records
