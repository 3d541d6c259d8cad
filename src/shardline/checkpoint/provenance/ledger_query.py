"""Reading the ledger's table: its columns, every row, or only the rows about some checkpoints.

Note: the indexes. A ledger grows by a commit row per save and a tombstone per deletion (100k rows
after 50k saves with retention), while a save's retention and a resume need only the rows of the
few checkpoints in the directory: the rows naming them (``checkpoint``) and the commit rows of
their manifests and ancestors (``manifest_sha256``). Both columns are indexed (:data:`INDEXES`), so
those rows are found without reading the others. The indexes are created with a new ledger's
table and added to an existing one the first time it is opened for writing; a ledger without
them (written by an older version, or only ever read since) answers the same queries by a scan
of the table inside SQLite. They are not part of any row or its hash: older versions read and
append to an indexed ledger as before (SQLite keeps the indexes up to date).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from shardline.errors import LineageError

__all__ = ["INDEXES", "commit_directories", "has_event", "parent_lookup", "select", "table_columns"]

INDEXES = """
CREATE INDEX IF NOT EXISTS checkpoints_by_checkpoint ON checkpoints (checkpoint);
CREATE INDEX IF NOT EXISTS checkpoints_by_manifest ON checkpoints (manifest_sha256);
"""
_BOUND = 500  # values per IN (...): within SQLite's limit on bound parameters (999 in old builds)


def table_columns(conn: sqlite3.Connection, path: Path) -> list[str]:
    """The ``checkpoints`` table's columns (a ledger from before the event columns lacks them); none for a
    database with nothing in it, which a process killed between creating the file and its table leaves (a
    ledger never appended to).

    Raises:
        LineageError: the database holds something, but no ``checkpoints`` table.
    """
    have = [r[1] for r in conn.execute("PRAGMA table_info(checkpoints)")]
    if not have and conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0] != 0:
        raise LineageError(
            f"the lineage ledger {path} has no checkpoints table: it is not a shardline ledger or it "
            "was damaged; move it aside to start a new chain"
        )
    return have


def select(
    conn: sqlite3.Connection,
    columns: Sequence[str],
    path: Path,
    *,
    where: Mapping[str, Collection[str]] | None = None,
) -> list[dict[str, Any]]:
    """Rows as ``{column: value}`` (of ``columns``, those the table has), in append order: every row, or with
    ``where`` (``{column: values}``) the rows whose column holds one of the values, for any of the columns."""
    have = table_columns(conn, path)
    if not have:
        return []
    names = [c for c in columns if c in have]
    query = f"SELECT {', '.join(names)} FROM checkpoints"
    if where is None:
        return [dict(zip(names, r, strict=True)) for r in conn.execute(f"{query} ORDER BY seq")]
    found: dict[int, dict[str, Any]] = {}
    for column, wanted in where.items():
        values = sorted(set(wanted))
        for at in range(0, len(values), _BOUND):
            part = values[at : at + _BOUND]
            for r in conn.execute(f"{query} WHERE {column} IN ({', '.join('?' * len(part))})", part):
                fields = dict(zip(names, r, strict=True))
                found[fields["seq"]] = fields
    return [found[seq] for seq in sorted(found)]


def has_event(conn: sqlite3.Connection, path: Path, event: str) -> bool:
    """Whether any row records ``event`` (the scan stops at the first)."""
    if "event" not in table_columns(conn, path):
        return False
    return conn.execute("SELECT 1 FROM checkpoints WHERE event = ? LIMIT 1", (event,)).fetchone() is not None


def commit_directories(conn: sqlite3.Connection, path: Path) -> list[str]:
    """One checkpoint name per directory that commit rows name checkpoints in (the names up to their last ``/``
    grouped inside SQLite, so a long ledger's rows are not built one by one)."""
    have = table_columns(conn, path)
    if not have:
        return []
    commit = "(event IS NULL OR event = 'commit')" if "event" in have else "1"
    folder = "rtrim(checkpoint, replace(checkpoint, '/', ''))"  # the name up to and with its last '/'
    query = f"SELECT min(checkpoint) FROM checkpoints WHERE {commit} AND checkpoint != '' GROUP BY {folder}"
    return [r[0] for r in conn.execute(query)]


def parent_lookup(conn: sqlite3.Connection, path: Path) -> Callable[[str], str | None]:
    """``manifest hash -> the parent hash its newest commit row records`` (None: no such row, or no parent): one
    indexed query per call on ``conn``."""
    have = table_columns(conn, path)
    commit = "(event IS NULL OR event = 'commit')" if "event" in have else "1"
    query = f"SELECT parent_manifest_sha256 FROM checkpoints WHERE manifest_sha256 = ? AND {commit} ORDER BY seq DESC"

    def parent(manifest: str) -> str | None:
        found = conn.execute(f"{query} LIMIT 1", (manifest,)).fetchone() if have else None
        return found[0] if found else None

    return parent
