"""The ledger's indexes: a save's retention and a resume read only the rows about the checkpoints in the directory
(and the newest one's ancestors), found by the indexes on ``checkpoint`` and ``manifest_sha256``, so their cost does
not grow with the ledger (provenance/ledger_query.py, provenance/directory_rows.py). An old ledger without the
indexes still reads, read-only, and gets them when next opened for writing."""

from __future__ import annotations

import json
import sqlite3
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from benchmarks import scale_ledger

from shardline.checkpoint.lifecycle.resume import find_candidates
from shardline.checkpoint.provenance import ledger as ledger_module
from shardline.checkpoint.provenance.ledger import Ledger
from shardline.checkpoint.provenance.ledger_query import commit_directories, has_event
from shardline.checkpoint.storage.stores import locate

INDEXES = {"checkpoints_by_checkpoint", "checkpoints_by_manifest"}


@contextmanager
def _rows_built(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Count the ledger rows built from the table (each row read becomes a ``LedgerRow``)."""
    count = [0]
    real = ledger_module.LedgerRow

    def counting(**fields: object) -> ledger_module.LedgerRow:
        count[0] += 1
        return real(**fields)  # type: ignore[arg-type]

    with monkeypatch.context() as m:
        m.setattr(ledger_module, "LedgerRow", counting)
        yield count


def _run(root: Path, saves: int) -> scale_ledger._Run:
    """A run directory after ``saves`` saves with ``keep_last_n=3``: 3 checkpoints on disk, and the commit and
    tombstone rows of every deleted one (rows about other checkpoints)."""
    run = scale_ledger._Run(root, 8, 1, 3)
    for n in range(1, saves + 1):
        run.save(n * 100, retention=False)
    return run


def _rows_read(saves: int, monkeypatch: pytest.MonkeyPatch) -> tuple[int, int]:
    """Rows built by the next save's commit and retention, and by a resume's selection, after ``saves`` saves."""
    with tempfile.TemporaryDirectory(dir=scale_ledger._FAST) as tmp:
        run = _run(Path(tmp), saves)
        assert len(run.ledger.rows()) == 2 * saves - 3
        with _rows_built(monkeypatch) as saved:
            run.save((saves + 1) * 100)  # its commit row, then retention: deletes the oldest, with its tombstone
        kept = [f"step-{s * 100}" for s in (saves + 1, saves, saves - 1)]
        assert sorted(p.name for p in run.directory.iterdir()) == sorted(kept)
        with _rows_built(monkeypatch) as resumed:
            found = find_candidates("auto", directory=locate(run.directory), ledger=run.ledger)
        assert [Path(c.location).name for c in found.committed] == kept
        return saved[0], resumed[0]


def test_retention_and_resume_read_the_same_rows_however_long_the_ledger(monkeypatch: pytest.MonkeyPatch) -> None:
    short, long = _rows_read(10, monkeypatch), _rows_read(150, monkeypatch)  # 17 and 297 rows before the save
    assert short == long, (short, long)
    saved, resumed = long
    assert saved <= 24, long  # 2 appended, and the rows of the 4 checkpoints on disk (a few reads each)
    assert resumed <= 12, long  # the rows of the 3 on disk


def test_the_queries_use_the_indexes_and_answer_as_a_filter_of_every_row(monkeypatch: pytest.MonkeyPatch) -> None:
    with tempfile.TemporaryDirectory(dir=scale_ledger._FAST) as tmp:
        run = _run(Path(tmp), 20)
        ledger = run.ledger
        every = ledger.rows()
        names = {r.checkpoint for r in every[::3]} | {f"absent-{n}" for n in range(700)}  # > one IN (...) batch
        hashes = {r.manifest_sha256 for r in every[1::4]}
        expect = [r for r in every if r.checkpoint in names or r.manifest_sha256 in hashes]
        statements: list[str] = []
        real_connect = sqlite3.connect

        def traced(*args: object, **kwargs: object) -> sqlite3.Connection:
            conn = real_connect(*args, **kwargs)  # type: ignore[arg-type]
            conn.set_trace_callback(statements.append)
            return conn

        monkeypatch.setattr(sqlite3, "connect", traced)
        assert ledger.rows_about(checkpoints=names, manifests=hashes) == expect
        monkeypatch.undo()
        queries = [s for s in statements if s.startswith("SELECT") and " IN (" in s]
        assert len(queries) == 3, statements  # two batches of names, one of hashes
        with sqlite3.connect(ledger.path) as conn:
            plans = [" ".join(str(r[-1]) for r in conn.execute(f"EXPLAIN QUERY PLAN {q}")) for q in queries]
        assert all("USING INDEX checkpoints_by_" in p for p in plans), plans


def _indexes(path: Path) -> set[str]:
    with sqlite3.connect(path) as conn:
        return {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index'")} & INDEXES


def test_an_old_ledger_reads_without_the_indexes_and_gets_them_when_written() -> None:
    with tempfile.TemporaryDirectory(dir=scale_ledger._FAST) as tmp:
        run = _run(Path(tmp), 8)
        path = run.ledger.path
        assert _indexes(path) == INDEXES  # a new ledger has them
        with sqlite3.connect(path) as conn:  # as a ledger written before them
            for name in INDEXES:
                conn.execute(f"DROP INDEX {name}")
        conn.close()
        before = path.read_bytes()
        every = run.ledger.rows()
        wanted = {every[-1].checkpoint, every[0].checkpoint}
        path.chmod(0o444)
        path.parent.chmod(0o555)
        try:  # read-only: nothing is written, the queries scan instead
            old = Ledger(path)
            assert old.rows_about(checkpoints=wanted) == [r for r in every if r.checkpoint in wanted]
            assert old.read(lambda conn, path: has_event(conn, path, "tombstone"))
            assert old.read(commit_directories) == [every[0].checkpoint]  # one directory: checkpoints/
            newest = next(r for r in reversed(every) if r.is_commit)
            assert old.recorded_hash(locate(path.parent / newest.checkpoint)) == newest.manifest_sha256
        finally:
            path.parent.chmod(0o755)
            path.chmod(0o644)
        assert path.read_bytes() == before
        assert _indexes(path) == set()
        run.save(900)  # opened for writing: the indexes are added
        assert _indexes(path) == INDEXES
        assert run.ledger.verify(check_checkpoints=False).ok


def test_commit_directories_names_one_checkpoint_per_folder(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "lineage.sqlite")
    common = {"step": 1, "tag": None, "manifest_sha256": "a" * 64, "parent_manifest_sha256": None, "world_size": 1}
    for name in ("a/step-2", "a/step-1", "b/c/step-3", "s3://bkt/p/step-4", "step-5", ""):
        ledger.append(**common, checkpoint=name)
    ledger.append(**common, checkpoint="z/step-9", event="tombstone")  # not a commit: no folder of its own
    assert sorted(ledger.read(commit_directories)) == ["a/step-1", "b/c/step-3", "s3://bkt/p/step-4", "step-5"]
    parents = {ledger.locate(r.checkpoint).parent for r in ledger.rows() if r.is_commit and r.checkpoint}
    assert {ledger.locate(n).parent for n in ledger.read(commit_directories)} == parents


def test_lineage_prints_a_page_of_rows_and_verifies_the_whole_chain(capsys: pytest.CaptureFixture[str]) -> None:
    from shardline.cli.main import main as cli_main

    with tempfile.TemporaryDirectory(dir=scale_ledger._FAST) as tmp:
        _run(Path(tmp), 12)  # 21 rows
        assert cli_main(["lineage", tmp, "--limit", "3"]) == 0
        out = capsys.readouterr().out
        assert "showing 3 of 21 rows (#19 to #21); the whole chain is verified" in out
        assert [line.split()[0] for line in out.splitlines() if line.startswith("  #")] == ["#19", "#20", "#21"]
        assert "note(s) about rows before those shown are left out" in out
        assert "Chain verified" in out
        assert cli_main(["lineage", tmp, "--since", "20", "--json"]) == 0
        shown = json.loads(capsys.readouterr().out)
        assert [r["seq"] for r in shown["rows"]] == [20, 21]
        assert shown["rows_total"] == 21
        assert cli_main(["lineage", tmp, "--since", "99"]) == 0
        assert "showing 0 of 21 rows (none from #99 on)" in capsys.readouterr().out
        for bad in (["--limit", "0"], ["--since", "-3"], ["--limit", "ten"]):
            with pytest.raises(SystemExit) as exit_:
                cli_main(["lineage", tmp, *bad])
            assert exit_.value.code == 2
            assert f"expected a whole number of at least 1, got {bad[1]!r}" in capsys.readouterr().err


def test_the_report_shows_a_page_and_counts_the_rest_all_checked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from shardline.cli.main import main as cli_main
    from shardline.report.html import write_report

    with tempfile.TemporaryDirectory(dir=scale_ledger._FAST) as tmp:
        _run(Path(tmp), 12)  # 12 checkpoints recorded: 3 on disk, 9 deleted with tombstones
        path, facts = write_report(tmp, out=tmp_path / "page.html", limit=2)
        assert len(facts.checkpoints) == 12  # every one checked
        page = path.read_text(encoding="utf-8")
        assert page.count('<section class="card"') == 2
        first = facts.checkpoints[-2].row.seq
        assert f"shows the newest 2 of 12 recorded checkpoints and the ledger from row #{first} on" in page
        # the simulated checkpoints hold no data files, so the one still on disk fails its full verification
        assert "The 10 older ones were checked the same way: 9 deleted, 1 failed." in page
        assert "every one of the ledger&#x27;s 21 rows" in page
        whole = write_report(tmp, out=tmp_path / "all.html")[0].read_text(encoding="utf-8")
        assert whole.count('<section class="card"') == 12
        assert "older ones were checked" not in whole
        with pytest.raises(SystemExit) as exit_:
            cli_main(["report", tmp, "--limit", "0"])
        assert exit_.value.code == 2
        assert "expected a whole number of at least 1, got '0'" in capsys.readouterr().err


def test_the_branch_walk_places_each_checkpoint_as_the_whole_branch_does(tmp_path: Path) -> None:
    from shardline.checkpoint.provenance.directory import CommittedCheckpoint
    from shardline.checkpoint.provenance.directory_rows import live_branch_placing
    from shardline.checkpoint.provenance.lineage import live_branch

    ledger = Ledger(tmp_path / "lineage.sqlite")
    chain = [f"{n:064x}" for n in range(1, 61)]  # each the parent of the next
    for n, digest in enumerate(chain):
        parent = chain[n - 1] if n else None
        ledger.append(step=n, tag=None, checkpoint=f"step-{n}", manifest_sha256=digest,
                      parent_manifest_sha256=parent, world_size=1)  # fmt: skip

    def on_disk(n: int, parent: str | None, digest: str | None = None) -> CommittedCheckpoint:
        return CommittedCheckpoint(tmp_path / f"step-{n}", n, None, digest or chain[n], 0, parent, 1)

    newest = on_disk(59, chain[58])
    kept = [on_disk(57, chain[56]), on_disk(58, chain[57])]
    off = on_disk(99, chain[10], digest="f" * 64)  # a branch from step 10, abandoned
    rows = ledger.rows()
    for committed in ([*kept, newest], [off, *kept, newest]):
        placed = live_branch_placing(ledger, newest, committed)
        whole = live_branch(newest, committed, rows)
        assert {c.manifest_hash for c in committed} & placed == {c.manifest_hash for c in committed} & whole
    assert live_branch_placing(ledger, newest, [*kept, newest]) == set(chain[57:])  # stopped at the oldest kept
    assert live_branch_placing(ledger, newest, [off, *kept, newest]) == set(chain)  # walked to the first
