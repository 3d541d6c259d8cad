"""What retention and resume selection need of a committed checkpoint, without parsing its whole manifest.

At 16,384 ranks x 8 files a manifest is 17 MB: 131k file entries. Retention (at every save) and
resume selection read the step, tag, manifest hash, parent hash and world size of each checkpoint
in the directory, and a tombstone what the deleted one held (file count, bytes) -- never the file
list. Parsing and re-encoding each manifest to check it cost about 0.5 s per checkpoint there.

Note: the check. A checkpoint is taken from its ledger row (:func:`from_ledger`) only when its
``manifest.json`` bytes hash to the hash its ``manifest.sha256`` records **and** a commit row of
the same name records that hash. The row's hash is the SHA-256 of the canonical manifest shardline
wrote at that save, so matching bytes are that manifest, canonical: what :func:`.read_manifest`
proves by parsing and re-encoding, proven by the hash alone (one SHA-256 pass, 16 ms at 17 MB).
The row's step, tag, parent hash and world size were recorded from the same save; the manifest's
creation time, which no row records, is read from the manifest's first keys (canonical JSON sorts
them: ``created_unix_ns`` comes before ``files``). Anything else -- no row, another hash, a
manifest that does not match, an old ledger -- falls back to the full read, which reports damage
as before. No format change: the commit row's ``detail.held`` (file count and bytes, as the save
counted them; :func:`.records.commit_row`) is new, and a row without it is served by parsing.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeGuard

from shardline.checkpoint.format.canonical import sha256_hex
from shardline.checkpoint.integrity.manifest import (
    MANIFEST,
    read_checkpoint_file,
    recorded_manifest_hash,
)
from shardline.checkpoint.provenance.directory import CommittedCheckpoint
from shardline.checkpoint.provenance.ledger import LedgerRow
from shardline.checkpoint.storage.protocol import CHECKPOINT_NAME, Location

__all__ = ["commit_rows", "from_ledger", "held_recorded"]

_HEAD_BYTES = 1 << 16  # the manifest's keys before "files" (config hash, contents, creation time) fit many times


def commit_rows(rows: Iterable[LedgerRow]) -> dict[tuple[str, str], LedgerRow]:
    """``(checkpoint name, manifest hash) -> its newest commit row``."""
    return {(r.checkpoint, r.manifest_sha256): r for r in rows if r.is_commit}


def from_ledger(
    rows: Iterable[LedgerRow], rel: Callable[[Location], str]
) -> Callable[[Location], CommittedCheckpoint | None]:
    """For :func:`.directory.scan`: a ``step-N`` directory as its commit row records it, or None (read it whole).

    ``rel`` turns a checkpoint path into the name the ledger uses for it. See the module note for the check.
    """
    known = commit_rows(rows)

    def recorded(child: Location) -> CommittedCheckpoint | None:
        match = CHECKPOINT_NAME.match(child.name)
        if not known or match is None:
            return None
        digest = recorded_manifest_hash(child)
        row = known.get((rel(child), digest)) if digest else None
        if row is None or row.step != int(match["step"]) or row.tag != match["tag"]:
            return None
        file = child / MANIFEST
        if not file.is_file():
            return None  # the full read says what it is (not a committed checkpoint)
        try:
            raw = read_checkpoint_file(file)
        except FileNotFoundError:
            return None
        if sha256_hex(raw) != digest:
            return None  # altered or damaged: the full read says how
        created = _created_unix_ns(raw)
        if created is None:
            return None
        return CommittedCheckpoint(
            path=child,
            step=row.step,
            tag=row.tag,
            manifest_hash=row.manifest_sha256,
            created_unix_ns=created,
            parent_manifest_hash=row.parent_manifest_sha256,
            world_size=row.world_size,
        )

    return recorded


def held_recorded(row: LedgerRow | None) -> dict[str, int] | None:
    """``{"files", "bytes"}`` that ``row`` (a commit row) records the checkpoint held, or None (not recorded)."""
    if row is None or not row.detail:
        return None
    try:
        detail = json.loads(row.detail)
    except ValueError:
        return None
    held = detail.get("held") if isinstance(detail, dict) else None
    if not isinstance(held, Mapping):
        return None
    files, size = held.get("files"), held.get("bytes")
    if _count(files) and _count(size):
        return {"files": files, "bytes": size}
    return None


def _count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _created_unix_ns(raw: bytes) -> int | None:
    """The manifest's ``created_unix_ns`` (0 when it has none, as :func:`.directory.scan` reads it), from its keys
    before ``files``; None when they cannot be read that way."""
    text = raw[:_HEAD_BYTES].decode("utf-8", "ignore")  # canonical (its hash matched), so only the cut can break
    decoder = json.JSONDecoder()
    if not text.startswith("{"):
        return None
    at = 1
    try:
        while True:
            key, at = decoder.raw_decode(text, at)
            if not isinstance(key, str) or text[at] != ":":
                return None
            if key > "created_unix_ns":
                return 0  # sorted keys: it has none
            value: Any
            value, at = decoder.raw_decode(text, at + 1)
            if key == "created_unix_ns":
                return value if isinstance(value, int) and not isinstance(value, bool) else None
            if text[at] != ",":
                return None
            at += 1
    except (ValueError, IndexError):
        return None
