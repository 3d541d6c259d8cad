"""The lineage ledger: an append-only SQLite table of committed checkpoints, hash-chained row by row.

Each row records one committed checkpoint (step, tag, directory, manifest hash, the manifest
hash of its parent) and ``prev_row_sha256``, the hash of the row before it (64 zeros for the
first). ``row_sha256`` is the SHA-256 of the canonical JSON of the row's other columns, so
editing, deleting or reordering any row breaks the chain from there on. Triggers refuse
``UPDATE`` and ``DELETE``; the chain catches edits made around them.

Note: SQLite needs working file locks; keep the ledger on a local or POSIX-compliant shared
file system (only rank 0 writes it).
"""

from __future__ import annotations

import datetime
import os
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from shardline.checkpoint.canonical import canonical_json, sha256_hex
from shardline.errors import LineageError

__all__ = ["GENESIS", "LEDGER_NAME", "Ledger", "LedgerRow", "LineageReport", "row_hash"]

LEDGER_NAME = "lineage.sqlite"
GENESIS = "0" * 64
_SCHEMA = """
CREATE TABLE IF NOT EXISTS checkpoints (
    seq INTEGER PRIMARY KEY,
    step INTEGER NOT NULL,
    tag TEXT,
    checkpoint TEXT NOT NULL,
    manifest_sha256 TEXT NOT NULL,
    parent_manifest_sha256 TEXT,
    world_size INTEGER NOT NULL,
    committed_at TEXT NOT NULL,
    recovered INTEGER NOT NULL DEFAULT 0,
    prev_row_sha256 TEXT NOT NULL,
    row_sha256 TEXT NOT NULL UNIQUE
);
CREATE TRIGGER IF NOT EXISTS checkpoints_no_update BEFORE UPDATE ON checkpoints
BEGIN SELECT RAISE(ABORT, 'the lineage ledger is append-only'); END;
CREATE TRIGGER IF NOT EXISTS checkpoints_no_delete BEFORE DELETE ON checkpoints
BEGIN SELECT RAISE(ABORT, 'the lineage ledger is append-only'); END;
"""
_COLUMNS = (
    "seq",
    "step",
    "tag",
    "checkpoint",
    "manifest_sha256",
    "parent_manifest_sha256",
    "world_size",
    "committed_at",
    "recovered",
    "prev_row_sha256",
    "row_sha256",
)


@dataclass(frozen=True)
class LedgerRow:
    """One committed checkpoint in the ledger."""

    seq: int
    step: int
    tag: str | None
    checkpoint: str
    manifest_sha256: str
    parent_manifest_sha256: str | None
    world_size: int
    committed_at: str
    recovered: bool
    prev_row_sha256: str
    row_sha256: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def row_hash(fields: dict[str, Any]) -> str:
    """SHA-256 of the canonical JSON of a row's columns other than ``row_sha256``."""
    body = {k: fields[k] for k in _COLUMNS if k != "row_sha256"}
    body["recovered"] = bool(body["recovered"])
    return sha256_hex(canonical_json(body))


@dataclass(frozen=True)
class LineageReport:
    """Outcome of :meth:`Ledger.verify`: the rows, and every problem found (empty when the chain holds)."""

    path: str
    rows: tuple[LedgerRow, ...]
    problems: tuple[str, ...] = field(default_factory=tuple)
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {
            "ledger": self.path,
            "ok": self.ok,
            "rows": [r.to_json() for r in self.rows],
            "problems": list(self.problems),
            "notes": list(self.notes),
        }


class Ledger:
    """The append-only, hash-chained ledger at ``path`` (created on first append)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)

    @contextmanager
    def _connect(self, *, create: bool) -> Iterator[sqlite3.Connection]:
        if not create and not self.path.is_file():
            raise LineageError(f"no lineage ledger at {self.path}")
        try:
            conn = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
        except sqlite3.Error as e:
            raise LineageError(f"cannot open the lineage ledger {self.path}: {e}") from None
        try:
            conn.execute("PRAGMA journal_mode=DELETE")
            conn.execute("PRAGMA synchronous=FULL")
            if create:
                conn.executescript(_SCHEMA)
            yield conn
        except sqlite3.DatabaseError as e:
            raise LineageError(f"the lineage ledger {self.path} is unreadable or damaged: {e}") from None
        finally:
            conn.close()

    def rows(self) -> list[LedgerRow]:
        """Every row, in append order."""
        with self._connect(create=False) as conn:
            cur = conn.execute(f"SELECT {', '.join(_COLUMNS)} FROM checkpoints ORDER BY seq")
            return [LedgerRow(**{**dict(zip(_COLUMNS, r, strict=True)), "recovered": bool(r[8])}) for r in cur]

    def append(
        self,
        *,
        step: int,
        tag: str | None,
        checkpoint: str,
        manifest_sha256: str,
        parent_manifest_sha256: str | None,
        world_size: int,
        recovered: bool = False,
    ) -> LedgerRow:
        """Append one committed checkpoint, chained to the last row (in one exclusive transaction)."""
        with self._connect(create=True) as conn:
            conn.execute("BEGIN EXCLUSIVE")
            try:
                last = conn.execute("SELECT seq, row_sha256 FROM checkpoints ORDER BY seq DESC LIMIT 1").fetchone()
                fields: dict[str, Any] = {
                    "seq": (last[0] + 1) if last else 1,
                    "step": int(step),
                    "tag": tag,
                    "checkpoint": checkpoint,
                    "manifest_sha256": manifest_sha256,
                    "parent_manifest_sha256": parent_manifest_sha256,
                    "world_size": int(world_size),
                    "committed_at": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
                    "recovered": bool(recovered),
                    "prev_row_sha256": last[1] if last else GENESIS,
                }
                fields["row_sha256"] = row_hash(fields)
                conn.execute(
                    f"INSERT INTO checkpoints ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))})",
                    [int(fields[c]) if c == "recovered" else fields[c] for c in _COLUMNS],
                )
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
        return LedgerRow(**fields)

    def manifest_hashes(self) -> set[str]:
        """Manifest hashes of every recorded checkpoint (empty if the ledger does not exist yet)."""
        if not self.path.is_file():
            return set()
        return {r.manifest_sha256 for r in self.rows()}

    def verify(self, *, check_checkpoints: bool = True) -> LineageReport:
        """Recompute every row hash and link; with ``check_checkpoints``, also compare each checkpoint still on
        disk (``checkpoint`` is relative to the ledger's directory) with its recorded manifest hash. Deleted
        checkpoints are noted, not errors."""
        from shardline.checkpoint.manifest import read_manifest  # verification helpers, not needed to append

        rows = self.rows()
        problems: list[str] = []
        notes: list[str] = []
        prev = GENESIS
        seen: set[str] = set()
        for i, row in enumerate(rows):
            fields = row.to_json()
            if row.seq != i + 1:
                problems.append(f"row {i + 1}: sequence number {row.seq} (rows were removed or reordered)")
            if row.prev_row_sha256 != prev:
                problems.append(
                    f"row {row.seq} (step {row.step}): links to {row.prev_row_sha256[:12]}, previous row is {prev[:12]}"
                )
            if row_hash(fields) != row.row_sha256:
                problems.append(f"row {row.seq} (step {row.step}): its contents do not match its row hash (edited)")
            if row.parent_manifest_sha256 and row.parent_manifest_sha256 not in seen:
                notes.append(
                    f"row {row.seq} (step {row.step}): parent {row.parent_manifest_sha256[:12]} is not in this ledger "
                    "(resumed from another run's checkpoint)"
                )
            seen.add(row.manifest_sha256)
            prev = row.row_sha256
            if not check_checkpoints:
                continue
            where = self.path.parent / row.checkpoint
            if not where.exists():
                notes.append(f"row {row.seq} (step {row.step}): {row.checkpoint} is no longer on disk")
                continue
            try:
                _, digest = read_manifest(where)
            except Exception as e:
                problems.append(f"row {row.seq} (step {row.step}): {row.checkpoint}: {e}")
                continue
            if digest != row.manifest_sha256:
                problems.append(
                    f"row {row.seq} (step {row.step}): {row.checkpoint} has manifest hash {digest}, the ledger records "
                    f"{row.manifest_sha256}"
                )
        return LineageReport(str(self.path), tuple(rows), tuple(problems), tuple(notes))
