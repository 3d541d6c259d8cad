"""The lineage ledger: an append-only SQLite table of committed checkpoints, hash-chained row by row.

Each row records one committed checkpoint (step, tag, directory, manifest hash, the manifest
hash of its parent) and ``prev_row_sha256``, the hash of the row before it (64 zeros for the
first). ``row_sha256`` is the SHA-256 of the canonical JSON of the row's other columns, so
editing, deleting or reordering any row breaks the chain from there on. Triggers refuse
``UPDATE`` and ``DELETE``; the chain catches edits made around them.

Rows other than commits carry an ``event``: ``quarantine`` (a checkpoint that failed
verification was moved aside), ``resume`` (a load that checked less than every byte, an
explicit opt-in), ``chain_break`` (the first row of a new chain started after the previous
ledger failed to verify), ``tombstone`` (a checkpoint deleted on purpose -- by retention, or
recorded by hand -- with what it held; :mod:`.retention`). Each kind is written by its operation in
:mod:`.records`, the one writer of rows besides the chain break here. ``detail`` holds the event's
canonical JSON; a commit row's ``detail`` names its provenance statement and that file's SHA-256. Rows written before
these columns existed have them NULL, and a NULL ``event``/``detail`` is left out of the row hash.

Note: the head record. After each append the ledger's last row (``seq row_sha256``) is written
to ``<ledger>.head`` beside it. Deleting rows from the end of the table keeps the chain
internally consistent -- every remaining link still matches -- so the head record is what
shows it: a ledger that ends before the row its head names has lost its tail. A ledger may
reach beyond its head (a crash between a row's commit and the head's rewrite leaves the head
one row behind); it may never end before it. A new ledger gets a *genesis* head
(``0 000...0``, "the empty chain") before its first row is inserted, so the same rule covers
a crash right after the first row: the head is behind, not missing. A missing head with rows
that carry events is still a problem -- nothing shardline does leaves one.

Note: a new chain (:meth:`Ledger.start_new_chain`) has one commit point. The new ledger is
built completely under a temporary name, the old ledger and head are copied aside, the head
record is pointed at the new chain's first row (which the old ledger cannot match), and only
then is the new file renamed over the old one; the head is rewritten to its last row after.
A crash before the rename leaves the old ledger, still refused, and running ``--new-chain``
again starts over; after it, the new chain opens like any other (its head one or more rows
behind, never ahead).

Note: a new ledger appears whole. Its schema is built in a temporary file beside it
(``.<ledger>.creating-<pid>-<random>``), flushed, and then hard-linked to the ledger's name, which
fails if another writer made it first (one rename where the file system has no hard links). A
process killed while SQLite creates the file and its table leaves only that temporary file
(removed by the next creation once its process is gone), never a half-made ledger. A table-less,
empty database at the ledger's name -- what versions before this one could leave -- is still
read as a ledger with no rows, and the next append builds its table.

Note: SQLite needs working file locks; keep the ledger on a local or POSIX-compliant shared
file system (only rank 0 writes it).
"""

from __future__ import annotations

import datetime
import json
import os
import secrets
import shutil
import sqlite3
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from shardline.checkpoint.faults.crashpoints import crash_point
from shardline.checkpoint.format.canonical import canonical_json, sha256_hex
from shardline.checkpoint.provenance.ledger_query import INDEXES, select
from shardline.checkpoint.storage.fsutil import atomic_write_bytes, fsync_dir, fsync_file
from shardline.checkpoint.storage.protocol import Location
from shardline.checkpoint.storage.stores import Locations, ledger_name
from shardline.errors import LineageError

__all__ = ["COMMIT", "GENESIS", "LEDGER_NAME", "TOMBSTONE", "Ledger", "LedgerRow", "LineageReport", "row_hash"]

LEDGER_NAME = "lineage.sqlite"
T = TypeVar("T")
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
    row_sha256 TEXT NOT NULL UNIQUE,
    event TEXT,
    detail TEXT
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
    "event",
    "detail",
)
_ADDED = ("event", "detail")  # columns added later: a NULL there is not part of the row hash
COMMIT = "commit"
TOMBSTONE = "tombstone"
RESTART = "restart"
QUARANTINE = "quarantine"
RESUME = "resume"
CHAIN_BREAK = "chain_break"
EVENTS = (COMMIT, QUARANTINE, RESUME, CHAIN_BREAK, TOMBSTONE, RESTART)


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
    event: str | None = None
    detail: str | None = None

    @property
    def is_commit(self) -> bool:
        """Whether the row records a committed checkpoint (rows from before events existed are commits)."""
        return self.event in (None, COMMIT)

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _COLUMNS}  # plain values: no deep copy (asdict's)


def row_hash(fields: dict[str, Any]) -> str:
    """SHA-256 of the canonical JSON of a row's columns but ``row_sha256`` (a NULL ``event``/``detail`` left out)."""
    body = {k: fields.get(k) for k in _COLUMNS if k != "row_sha256"}
    for key in _ADDED:
        if body[key] is None:
            del body[key]
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
    """The append-only, hash-chained ledger at ``path`` (created on first append), with its head record.

    ``storage_options`` reach the object store of rows that name a checkpoint by URL (endpoint,
    credentials: what ``checkpoint.storage_options`` held when they were saved); see :meth:`locate`.
    """

    def __init__(self, path: str | os.PathLike[str], *, storage_options: Mapping[str, Any] | None = None) -> None:
        self.path = Path(path)
        self.storage_options = dict(storage_options or {})
        self._located = Locations(storage_options=self.storage_options, relative_to=self.path.parent)

    def locate(self, checkpoint: str) -> Location:
        """Where a row's ``checkpoint`` lives: a URL in its object store, else a path relative to the ledger."""
        return self._located(checkpoint)

    def name_of(self, checkpoint: Location) -> str:
        """How a row names ``checkpoint``: its path relative to the ledger's directory, or its URL."""
        return ledger_name(checkpoint, relative_to=self.path.parent)

    @property
    def head_path(self) -> Path:
        """``<ledger>.head``: the last appended row's ``seq row_sha256``."""
        return self.path.with_name(self.path.name + ".head")

    def head_record(self) -> tuple[int, str] | None:
        """``(seq, row_sha256)`` from the head record, or None when there is none (or it is unreadable)."""
        try:
            parts = self.head_path.read_text(encoding="ascii").split()
            return int(parts[0]), parts[1]
        except (OSError, UnicodeDecodeError, ValueError, IndexError):
            return None

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
                conn.executescript(_SCHEMA + INDEXES)  # indexes: also added to old ledgers
            yield conn
        except sqlite3.DatabaseError as e:
            raise LineageError(f"the lineage ledger {self.path} is unreadable or damaged: {e}") from None
        finally:
            conn.close()

    @staticmethod
    def _upgrade(conn: sqlite3.Connection) -> None:
        """Add the event columns to a ledger written before they existed (its old rows keep NULL there)."""
        have = {r[1] for r in conn.execute("PRAGMA table_info(checkpoints)")}
        for column in _ADDED:
            if have and column not in have:
                conn.execute(f"ALTER TABLE checkpoints ADD COLUMN {column} TEXT")

    def rows(self) -> list[LedgerRow]:
        """Every row, in append order."""
        with self._connect(create=False) as conn:
            return [_row(fields) for fields in select(conn, _COLUMNS, self.path)]

    def rows_about(self, *, checkpoints: Collection[str] = (), manifests: Collection[str] = ()) -> list[LedgerRow]:
        """Rows naming one of ``checkpoints`` or recording a manifest hash in ``manifests`` (:mod:`.ledger_query`)."""
        if not self.path.is_file() or not (checkpoints or manifests):
            return []
        where = {"checkpoint": checkpoints, "manifest_sha256": manifests}
        with self._connect(create=False) as conn:
            return [_row(fields) for fields in select(conn, _COLUMNS, self.path, where=where)]

    def read(self, query: Callable[[sqlite3.Connection, Path], T]) -> T:
        """``query(connection, path)`` over the ledger opened for reading (a function of :mod:`.ledger_query`)."""
        with self._connect(create=False) as conn:
            return query(conn, self.path)

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
        event: str = COMMIT,
        detail: dict[str, Any] | None = None,
    ) -> LedgerRow:
        """Append one row (a committed checkpoint, or an ``event``), chained to the last row (the generic writer:
        code outside :mod:`.records` records rows with its operations, one per kind).

        One exclusive transaction; then the head record is rewritten atomically.
        """
        if event not in EVENTS:
            raise ValueError(f"unknown ledger event {event!r}; events are {', '.join(EVENTS)}")
        if not self.path.exists():
            self._create()
        with self._connect(create=True) as conn:
            self._upgrade(conn)
            conn.execute("BEGIN EXCLUSIVE")
            try:
                last = conn.execute("SELECT seq, row_sha256 FROM checkpoints ORDER BY seq DESC LIMIT 1").fetchone()
                if last is None and self.head_record() is None:
                    self.write_head(0, GENESIS)
                    crash_point("ledger.genesis_head")
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
                    "event": event,
                    "detail": canonical_json(detail).decode("utf-8") if detail is not None else None,
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
        crash_point("ledger.row_committed")
        self.write_head(fields["seq"], fields["row_sha256"])
        return LedgerRow(**fields)

    def _create(self) -> None:
        """Make an empty ledger (its table and triggers) at :attr:`path` in one step (see the module note)."""
        self._remove_abandoned_builds()
        building = self.path.with_name(f".{self.path.name}.creating-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            conn = sqlite3.connect(building, isolation_level=None)
            try:
                conn.execute("PRAGMA journal_mode=DELETE")
                conn.execute("PRAGMA synchronous=FULL")
                conn.executescript(_SCHEMA + INDEXES)
            finally:
                conn.close()
            fsync_file(building)
            crash_point("ledger.built")
            try:
                os.link(building, self.path)
            except FileExistsError:
                pass  # another writer created it first: use theirs
            except OSError:  # no hard links here: a rename, unless the ledger appeared meanwhile
                if not self.path.exists():
                    os.replace(building, self.path)
        except sqlite3.Error as e:
            raise LineageError(f"cannot create the lineage ledger {self.path}: {e}") from None
        finally:
            building.unlink(missing_ok=True)
        fsync_dir(self.path.parent)
        crash_point("ledger.created")

    def _remove_abandoned_builds(self) -> None:
        """Remove temporary ledgers that a killed creation left (their process is gone)."""
        for leftover in self.path.parent.glob(f".{self.path.name}.creating-*"):
            pid = leftover.name.rsplit("-", 2)[-2]
            if pid.isdigit() and not _alive(int(pid)):
                leftover.unlink(missing_ok=True)

    def write_head(self, seq: int, row_sha256: str) -> None:
        """Replace the head record with ``seq row_sha256`` atomically (``0`` and 64 zeros: the empty chain)."""
        atomic_write_bytes(self.head_path, f"{seq} {row_sha256}\n".encode(), crash_name="head")

    def manifest_hashes(self) -> set[str]:
        """Manifest hashes of every recorded checkpoint (empty if the ledger does not exist yet)."""
        if not self.path.is_file():
            return set()
        return {r.manifest_sha256 for r in self.rows() if r.is_commit}

    def recorded_hash(self, checkpoint: Location) -> str | None:
        """The manifest hash the newest commit row records for the checkpoint ``checkpoint`` (None if none)."""
        if not self.path.is_file():
            return None
        rel = self.name_of(checkpoint)
        found = [r.manifest_sha256 for r in self.rows_about(checkpoints=[rel]) if r.is_commit and r.checkpoint == rel]
        return found[-1] if found else None

    def start_new_chain(
        self, *, reason: str, problems: list[str], rows: list[dict[str, Any]] | None = None
    ) -> tuple[Path, list[LedgerRow]]:
        """Keep this ledger (and its head record) aside and start a new one whose first row records the break.

        The old file is kept as ``<stem>.broken-<UTC time><suffix>`` and named, with its SHA-256
        and last row, in the new ``chain_break`` row; ``rows`` (keyword arguments of :meth:`append`)
        follow it. The switch is one rename (see the module note), so a crash leaves either the old
        ledger or the whole new one. Returns (where the old ledger went, the new rows).
        """
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        aside = self.path.with_name(f"{self.path.stem}.broken-{stamp}{self.path.suffix}")
        n = 1
        while aside.exists():
            aside = self.path.with_name(f"{self.path.stem}.broken-{stamp}-{n}{self.path.suffix}")
            n += 1
        detail: dict[str, Any] = {"reason": reason, "problems": list(problems)}
        if self.path.is_file():
            detail["previous_ledger"] = aside.name
            detail["previous_ledger_sha256"] = sha256_hex(self.path.read_bytes())
            try:
                old_rows = self.rows()
            except LineageError:
                old_rows = []
            if old_rows:
                detail["previous_last_row"] = {"seq": old_rows[-1].seq, "row_sha256": old_rows[-1].row_sha256}
        for leftover in self.path.parent.glob(f".{self.path.name}.new-*"):  # from a new chain a crash interrupted
            leftover.unlink()
        building = Ledger(self.path.with_name(f".{self.path.name}.new-{stamp}"))
        made = [
            building.append(
                step=0,
                tag=None,
                checkpoint="",
                manifest_sha256="",
                parent_manifest_sha256=None,
                world_size=0,
                event=CHAIN_BREAK,
                detail=detail,
            )
        ]
        made += [building.append(**row) for row in rows or []]
        fsync_file(building.path)
        crash_point("new_chain.built")
        if self.path.is_file():
            shutil.copy2(self.path, aside)
            fsync_file(aside)
        if self.head_path.is_file():
            head_aside = aside.with_name(aside.name + ".head")
            shutil.copy2(self.head_path, head_aside)
            fsync_file(head_aside)
        fsync_dir(self.path.parent)
        crash_point("new_chain.kept_aside")
        self.write_head(made[0].seq, made[0].row_sha256)  # the new chain's first row: the old ledger cannot match it
        os.replace(building.path, self.path)
        fsync_dir(self.path.parent)
        crash_point("new_chain.swapped")
        building.head_path.unlink(missing_ok=True)
        self.write_head(made[-1].seq, made[-1].row_sha256)
        return aside, made

    def verify(self, *, check_checkpoints: bool = True) -> LineageReport:
        """Recompute every row hash and link; with ``check_checkpoints``, also compare each checkpoint still on
        disk (``checkpoint`` is relative to the ledger's directory) with its recorded manifest hash. Deleted
        checkpoints are problems unless a later ``tombstone`` (or ``quarantine``) row accounts for them."""
        from shardline.checkpoint.integrity.manifest import read_manifest  # verification helpers, not needed to append

        rows = self.rows()
        problems: list[str] = []
        notes: list[str] = []
        problems += self.head_problems(rows)
        prev = GENESIS
        seen: set[str] = set()
        moved = _moves(rows)
        buried = _tombstones(rows)
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
            if not row.is_commit:
                prev = row.row_sha256
                continue
            if row.parent_manifest_sha256 and row.parent_manifest_sha256 not in seen:
                notes.append(
                    f"row {row.seq} (step {row.step}): parent {row.parent_manifest_sha256[:12]} is not in this ledger "
                    "(resumed from another run's checkpoint)"
                )
            seen.add(row.manifest_sha256)
            prev = row.row_sha256
            if not check_checkpoints:
                continue
            later = next(((seq, to) for seq, to in moved.get(row.checkpoint, []) if seq > row.seq), None)
            if later is not None:
                notes.append(
                    f"row {row.seq} (step {row.step}): {row.checkpoint} failed verification and was moved aside to "
                    f"{later[1]} (row {later[0]})"
                )
                continue
            # A row naming a URL (checkpoints in an object store) is checked in the store itself.
            where = self.locate(row.checkpoint)
            tomb = next(
                (
                    t
                    for t in buried.get(row.checkpoint, [])
                    if t.seq > row.seq and t.manifest_sha256 == row.manifest_sha256
                ),
                None,
            )
            if tomb is not None:
                still = where.exists() and _manifest_hash_or_none(where) == row.manifest_sha256
                notes.append(
                    f"row {row.seq} (step {row.step}): {row.checkpoint} "
                    + (
                        f"is recorded deleted (tombstone row {tomb.seq}) but still on disk: an interrupted deletion "
                        "that the next save finishes"
                        if still
                        else f"was retired on purpose and moved to {moved_to}; tombstone row {tomb.seq} records it"
                        if (moved_to := _detail(tomb).get("moved_to"))
                        else f"was deleted on purpose; tombstone row {tomb.seq} records what it held"
                    )
                )
                continue
            if not where.exists():
                problems.append(
                    f"row {row.seq} (step {row.step}): {row.checkpoint} is gone from disk and no tombstone row records "
                    "its deletion (deleted outside shardline, or lost); if it was deleted on purpose, record that with "
                    "`shardline lineage RUN_DIR --record-deletions`"
                )
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

    def head_problems(self, rows: list[LedgerRow] | None = None) -> list[str]:
        """The ledger must reach the row its head record names (rows removed from the end show here)."""
        if rows is None:
            rows = self.rows() if self.path.is_file() else []
        head = self.head_record()
        last = rows[-1] if rows else None
        if head is None:
            if self.head_path.exists() or any(r.event is not None for r in rows):
                return [
                    f"the head record {self.head_path.name} is missing or unreadable: the ledger's end cannot be "
                    "checked"
                ]
            return []
        seq, digest = head
        if seq == 0 and digest == GENESIS:
            return []  # the empty chain: every ledger reaches it (a new ledger before its first head rewrite)
        match = next((r for r in rows if r.seq == seq), None)
        if match is None:
            ends = f"row {last.seq} (step {last.step})" if last else "no row at all"
            return [
                f"rows are missing from the end of the ledger: it ends at {ends}, but {self.head_path.name} records "
                f"row {seq} ({digest[:12]})"
            ]
        if match.row_sha256 != digest:
            return [
                f"row {seq} differs from the one {self.head_path.name} records ({digest[:12]}): the ledger was replaced"
            ]
        return []


def _row(fields: dict[str, Any]) -> LedgerRow:
    return LedgerRow(**{**fields, "recovered": bool(fields["recovered"])})


def _detail(row: LedgerRow) -> dict[str, Any]:
    """An event row's detail as a dict (empty when it has none or it does not parse)."""
    try:
        detail = json.loads(row.detail) if row.detail else {}
    except ValueError:
        return {}
    return detail if isinstance(detail, dict) else {}


def _alive(pid: int) -> bool:
    """Whether a process with this pid runs on this host."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _tombstones(rows: list[LedgerRow]) -> dict[str, list[LedgerRow]]:
    """``checkpoint -> its tombstone rows`` (deletions on purpose)."""
    out: dict[str, list[LedgerRow]] = {}
    for row in rows:
        if row.event == TOMBSTONE:
            out.setdefault(row.checkpoint, []).append(row)
    return out


def _manifest_hash_or_none(path: Location) -> str | None:
    from shardline.checkpoint.integrity.manifest import read_manifest

    try:
        return read_manifest(path)[1]
    except Exception:
        return None


def _moves(rows: list[LedgerRow]) -> dict[str, list[tuple[int, str]]]:
    """``checkpoint -> [(seq, moved_to)]`` from the ledger's ``quarantine`` rows."""
    out: dict[str, list[tuple[int, str]]] = {}
    for row in rows:
        if row.event == "quarantine" and row.detail:
            try:
                detail = json.loads(row.detail)
                out.setdefault(str(detail["checkpoint"]), []).append((row.seq, str(detail["moved_to"])))
            except (ValueError, KeyError, TypeError):
                continue
    return out
