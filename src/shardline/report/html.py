"""``shardline report``: one self-contained HTML page about a run, for a reviewer.

The page holds its own CSS and pictures (inline SVG; the run's ``loss.png`` as a base64 image
only when there is no ``metrics.csv`` to draw from), needs no JavaScript and loads nothing from
anywhere, so it can be mailed, archived or opened offline. It shows:

* the run summary (from ``summary.json``) and the loss curve (from ``metrics.csv``);
* the lineage chain as a picture: every ledger row, each checkpoint coloured by what verifying
  it found, arrows to its parent;
* per checkpoint, the plain-words summary, the verification outcome (the files are actually
  re-hashed against the manifest hash its ledger row records), its provenance statement, its
  signature status (checked when ``--public-key`` is given), and the exact commands to check it
  by hand with ``sha256sum`` and the OpenSSF ``model_signing`` tool.
"""

from __future__ import annotations

import base64
import datetime
import os
import shlex
from collections.abc import Mapping
from html import escape
from pathlib import Path
from typing import Any

from shardline._version import __version__
from shardline.checkpoint.lifecycle.summary import human_bytes
from shardline.checkpoint.provenance.lineage import describe_event, note_row
from shardline.checkpoint.storage.protocol import Location
from shardline.checkpoint.storage.stores import store_for
from shardline.report.collect import CheckpointFacts, RunFacts, Status, collect_run
from shardline.report.svg import STATUS_COLORS, lineage_svg, loss_svg

__all__ = ["REPORT_FILE", "render_report", "write_report"]

REPORT_FILE = "report.html"

_CSS = """
body{font:15px/1.5 -apple-system,'Segoe UI',Roboto,Helvetica,Arial,sans-serif;color:#202124;margin:0;background:#f8f9fa}
main{max-width:900px;margin:0 auto;padding:24px 28px 48px;background:#fff}
h1{font-size:26px;margin:4px 0 2px}h2{font-size:20px;margin:34px 0 10px;border-bottom:1px solid #dadce0}
h3{font-size:17px;margin:0 0 6px}.sub{color:#5f6368;margin:0 0 18px}
table.kv{border-collapse:collapse;width:100%;margin:6px 0 10px}
table.kv td{padding:3px 8px;border-bottom:1px solid #f1f3f4;vertical-align:top}
table.kv td:first-child{color:#5f6368;width:34%;white-space:nowrap}
code,pre,.hash{font-family:'SFMono-Regular',Menlo,Consolas,monospace;font-size:13px}
.hash{word-break:break-all}
pre{background:#202124;color:#e8eaed;padding:10px 12px;border-radius:6px;overflow-x:auto;white-space:pre-wrap}
.card{border:1px solid #dadce0;border-left-width:6px;border-radius:8px;padding:12px 16px;margin:14px 0}
.badge{display:inline-block;padding:1px 9px;border-radius:11px;font-size:12px;font-weight:600;color:#fff;
vertical-align:middle;margin-left:6px}
.ok{color:#1e8e3e}.bad{color:#d93025}.note{color:#5f6368;font-size:13px}
ul.problems{color:#d93025;margin:4px 0}
svg text.tick{font-size:11px;fill:#5f6368}svg text.axis{font-size:12px;fill:#3c4043}
svg text.label{font-size:13px;font-weight:600;fill:#202124}svg text.small{font-size:11.5px;fill:#3c4043}
svg text.status{font-size:11px;font-weight:700}
"""


def _q(path: Location | str) -> str:
    return shlex.quote(str(path))


def _kv(rows: list[tuple[str, Any]]) -> str:
    cells = "".join(f"<tr><td>{escape(k)}</td><td>{v}</td></tr>" for k, v in rows if v not in (None, ""))
    return f'<table class="kv">{cells}</table>'


def _h(value: object) -> str:
    return f'<span class="hash">{escape(str(value))}</span>' if value else "&mdash;"


def _summary_section(facts: RunFacts) -> str:
    s = facts.summary
    chain = facts.lineage
    verified = sum(1 for c in facts.checkpoints if c.status == Status.VERIFIED)
    rows: list[tuple[str, Any]] = [("run directory", _h(facts.run_dir))]
    if s:
        drop = s.get("initial_val_loss", 0) - s.get("final_val_loss", 0)
        rel = f" ({drop / s['initial_val_loss']:.0%} lower)" if s.get("initial_val_loss") else ""
        rows += [
            ("experiment", escape(str(s.get("experiment", "")))),
            ("strategy", escape(f"{s.get('strategy')}, {s.get('world_size')} ranks, precision {s.get('precision')}")),
            ("model", escape(f"{int(s.get('model_parameters', 0)):,} parameters")),
            ("steps / tokens", escape(f"{int(s.get('steps', 0)):,} / {int(s.get('tokens', 0)):,}")),
            ("wall time", escape(f"{float(s.get('wall_time_s', 0)):.1f} s")),
            (
                "validation loss",
                escape(f"{float(s.get('initial_val_loss', 0)):.4f} → {float(s.get('final_val_loss', 0)):.4f}{rel}"),
            ),
            ("training data", escape(str(s.get("corpus", "")))),
        ]
    else:
        rows.append(("summary", "no summary.json in the run directory (the run may still be going, or failed)"))
    if chain is not None:
        state = (
            '<span class="ok">verified</span>: every row hash and link matches, and the disk agrees with the chain'
            if chain.ok
            else f'<span class="bad">BROKEN</span>: {escape(chain.problems[0])}'
        )
        deleted = sum(1 for c in facts.checkpoints if c.status == Status.DELETED)
        read = (
            f"every one of the ledger's {len(chain.rows):,} rows (each row hash and link); every checkpoint still on "
            f"disk, every byte; the {deleted:,} deleted ones from their tombstone rows"
        )
        rows += [
            ("lineage ledger", _h(facts.ledger_path)),
            ("chain", state),
            ("checkpoints", escape(f"{len(facts.checkpoints)} recorded, {verified} verified on disk just now")),
            ("read for this page", escape(read)),
        ]
    else:
        rows.append(("lineage ledger", f'<span class="bad">{escape(facts.lineage_error or "none")}</span>'))
    return "<h2>Run summary</h2>" + _kv(rows)


def _loss_section(facts: RunFacts) -> str:
    picture = loss_svg([(int(m["step"]), m["loss"]) for m in facts.metrics], facts.val)
    if not picture and facts.loss_png is not None:
        data = base64.b64encode(facts.loss_png.read_bytes()).decode("ascii")
        picture = f'<img alt="loss plot" style="max-width:100%" src="data:image/png;base64,{data}">'
    if not picture:
        picture = '<p class="note">No metrics.csv or loss.png in the run directory.</p>'
    return "<h2>Loss</h2>" + picture


def _nodes(facts: RunFacts) -> list[dict[str, Any]]:
    by_seq: dict[int, dict[str, Any]] = {}
    for c in facts.checkpoints:
        r = c.row
        tag = f" [{r.tag}]" if r.tag else ""
        by_seq[r.seq] = {
            "kind": "commit",
            "seq": r.seq,
            "label": f"{c.name}{tag}",
            "detail": f"manifest {r.manifest_sha256[:16]}…  parent {(r.parent_manifest_sha256 or 'none')[:16]}  "
            f"· {r.committed_at[:19].replace('T', ' ')} UTC",
            "status": c.status,
            "id": r.manifest_sha256,
            "parent": r.parent_manifest_sha256,
        }
    for r in facts.events:
        by_seq[r.seq] = {"kind": "event", "seq": r.seq, "label": r.event or "event", "detail": describe_event(r)}
    return [by_seq[k] for k in sorted(by_seq)]


def _lineage_section(facts: RunFacts, first: int) -> str:
    legend = " ".join(
        f'<span class="badge" style="background:{stroke}">{escape(name)}</span>'
        for name, (_, stroke) in STATUS_COLORS.items()
    )
    every = facts.lineage.notes if facts.lineage else ()
    earlier = [n for n in every if 0 < note_row(n) < first]  # about rows the page leaves out
    notes = "".join(f"<li>{escape(n)}</li>" for n in every if n not in earlier)
    if earlier:
        notes += f"<li>{len(earlier):,} note(s) about the rows before #{first} are left out</li>"
    problems = "".join(f"<li>{escape(p)}</li>" for p in (facts.lineage.problems if facts.lineage else ()))
    return (
        "<h2>Lineage chain</h2>"
        '<p class="note">Each box is a checkpoint recorded in the hash-chained ledger, oldest at the top; an arrow '
        f"points from a checkpoint to the one it continues from; rounded grey rows are ledger events. {legend}</p>"
        + lineage_svg([n for n in _nodes(facts) if n["seq"] >= first])
        + (f'<ul class="problems">{problems}</ul>' if problems else "")
        + (f'<ul class="note">{notes}</ul>' if notes else "")
    )


def _provenance_rows(statement: dict[str, Any] | None) -> list[tuple[str, Any]]:
    if not statement:
        return [("provenance", "no provenance statement (saved before shardline wrote them)")]
    p = statement.get("predicate", {})
    code = p.get("code", {})
    commit = code.get("git_commit")
    dirty = {True: " (with uncommitted changes)", False: " (clean)", None: ""}[code.get("git_dirty")]
    dist = p.get("distributed", {})
    return [
        ("training config fingerprint", _h(p.get("training_config", {}).get("sha256"))),
        ("data fingerprint", _h(p.get("data", {}).get("fingerprint"))),
        ("parent manifest hash", _h(p.get("parent", {}).get("manifest_sha256")) + " "),
        (
            "code",
            escape(f"{code.get('name', 'shardline')} {code.get('version', '?')}")
            + (f", git commit {_h(commit)}{escape(dirty)}" if commit else ", no git checkout (an installed package)"),
        ),
        ("runtime", escape(f"torch {p.get('runtime', {}).get('torch')}, python {p.get('runtime', {}).get('python')}")),
        ("distributed", escape(f"{dist.get('world_size')} processes, strategy {dist.get('strategy') or 'unsharded'}")),
    ]


def _commands(c: CheckpointFacts, public_key: Path | None) -> str:
    key = _q(public_key) if public_key else "PUB.pem"
    where, signature = _q(c.path), _q(c.signature) if c.signature is not None else None
    lines = []
    copy = store_for(c.path).copy_command(c.path, c.path.name, recursive=True, note=True)
    if copy is not None:
        # Not local (a bucket): check it there with shardline, or copy it (and its signature) down for coreutils.
        where = c.path.name
        lines += [f"shardline verify {_q(c.path)} --expect {c.row.manifest_sha256}", copy]
        if c.signature is not None:
            lines += [
                f"{store_for(c.signature).copy_command(c.signature, f'{where}.sig', recursive=False)}",
                f"model_signing verify key --signature {where}.sig --public_key {key} {where}",
            ]
            signature = None  # checked above, before changing into the copy
    lines += [
        f"cd {where}",
        f"sha256sum manifest.json      # must print {c.row.manifest_sha256}",
        "sha256sum -c SHA256SUMS      # every line must say OK",
    ]
    if signature is not None:
        lines.append(f"model_signing verify key --signature {signature} --public_key {key} {where}")
    text = "\n".join(lines)
    more = (
        ""
        if c.signature is not None
        else f'<p class="note">Not signed. To sign it: <code>shardline sign {escape(_q(c.path))} --private-key '
        "KEY.pem</code>.</p>"
    )
    intro = (
        "<p>Check it yourself (GNU coreutils; the signature with <code>pip install model-signing pyOpenSSL</code>):</p>"
    )
    return f"{intro}<pre>{escape(text)}</pre>{more}"


def _verdict(c: CheckpointFacts) -> str:
    row = c.row
    if c.status == Status.VERIFIED:
        return (
            '<p class="ok">Verified just now: every file was re-hashed and matches the manifest, whose hash is the '
            f"one the ledger recorded when it was saved (row {row.seq}).</p>"
        )
    if c.status == Status.DELETED:
        t = c.tombstone or {}
        held = f"{t.get('files', '?')} files, {human_bytes(int(t.get('bytes', 0)))}" if t.get("bytes") else "its files"
        return (
            f'<p class="note">Deleted on purpose ({escape(str(t.get("reason", "")))}). It held {escape(held)}; its '
            "manifest hash, parent and provenance statement stay in the ledger, so the chain still verifies.</p>"
        )
    items = "".join(f"<li>{escape(p)}</li>" for p in c.problems) or "<li>see `shardline verify`</li>"
    return f'<p class="bad">{escape(c.status.upper())}:</p><ul class="problems">{items}</ul>'


def _statement_words(c: CheckpointFacts) -> str:
    if c.statement_source is None:
        return "none"
    where = (
        "provenance.intoto.json in the checkpoint"
        if c.statement_source == "checkpoint"
        else ("the copy its tombstone row keeps")
    )
    agree: dict[bool | None, str] = {
        True: "; its SHA-256 is the one the ledger row records",
        False: "; its SHA-256 DIFFERS from the ledger row",
    }
    return where + agree.get(c.statement_matches_ledger, "")


def _checkpoint_card(c: CheckpointFacts, public_key: Path | None) -> str:
    _, stroke = STATUS_COLORS.get(c.status, ("", "#9aa0a6"))
    row = c.row
    summary = "".join(f"<p>{escape(p)}</p>" for p in (c.summary_text or "").splitlines())
    kv = _kv(
        [
            ("manifest hash (ledger row)", _h(row.manifest_sha256)),
            ("saved", escape(f"{row.committed_at} by {row.world_size} processes")),
            ("provenance statement", escape(_statement_words(c))),
            *_provenance_rows(c.statement),
            ("signature", escape(c.signature_status)),
        ]
    )
    body = _verdict(c) + summary + kv + ("" if c.status == Status.DELETED else _commands(c, public_key))
    return (
        f'<section class="card" id="{escape(c.name)}" style="border-left-color:{stroke}">'
        f'<h3>{escape(c.name)} — step {row.step:,}<span class="badge" style="background:{stroke}">'
        f"{escape(c.status.upper())}</span></h3>{body}</section>"
    )


def _page(facts: RunFacts, limit: int | None) -> tuple[list[CheckpointFacts], int, str]:
    """The checkpoints shown (the newest ``limit``, or all), the first ledger row shown, and what the page leaves
    out, counted by outcome (every one was checked all the same)."""
    shown = facts.checkpoints[-limit:] if limit is not None else facts.checkpoints
    older = facts.checkpoints[: len(facts.checkpoints) - len(shown)]
    if not older:
        return shown, 0, ""
    counts: dict[str, int] = {}
    for c in older:
        counts[c.status] = counts.get(c.status, 0) + 1
    outcome = ", ".join(f"{n:,} {status}" for status, n in sorted(counts.items()))
    first = shown[0].row.seq if shown else 1
    said = (
        f'<p class="note">This page shows the newest {len(shown):,} of {len(facts.checkpoints):,} recorded checkpoints '
        f"and the ledger from row #{first} on (<code>--limit</code>). The {len(older):,} older ones were checked "
        f"the same way: {escape(outcome)}.</p>"
    )
    return shown, first, said


def render_report(facts: RunFacts, *, limit: int | None = None) -> str:
    """The HTML page for ``facts`` (see the module note); with ``limit``, the newest ``limit`` checkpoints in detail
    and the older ones counted by outcome (all of them were checked)."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    shown, first, left_out = _page(facts, limit)
    cards = "".join(_checkpoint_card(c, facts.public_key) for c in reversed(shown))
    run = _q(facts.run_dir)
    howto = (
        "<h2>How to check this run yourself</h2>"
        "<p>Everything above can be re-checked without this page. With shardline:</p>"
        f"<pre>shardline lineage {escape(run)}          # the chain: every row hash, link and checkpoint\n"
        f"shardline lineage {escape(run)} --json   # the same, with each checkpoint's provenance statement\n"
        f"shardline report {escape(run)} --public-key PUB.pem   # this page, signatures checked</pre>"
        "<p>Without shardline: the commands under each checkpoint (sha256sum, model_signing), and the ledger "
        "chain check with <code>python3</code> alone in docs/verification.md.</p>"
    )
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f"<title>shardline run report — {escape(facts.run_dir.name)}</title>"
        f'<meta name="viewport" content="width=device-width, initial-scale=1"><style>{_CSS}</style></head><body><main>'
        f"<h1>Training run report: {escape(facts.run_dir.name)}</h1>"
        f'<p class="sub">Written {now} by shardline {escape(__version__)}; every checkpoint below was verified '
        "when this page was written.</p>"
        + _summary_section(facts)
        + _loss_section(facts)
        + left_out
        + _lineage_section(facts, first)
        + "<h2>Checkpoints, newest first</h2>"
        + (cards or '<p class="note">No checkpoints recorded.</p>')
        + howto
        + "</main></body></html>\n"
    )


def write_report(
    run_dir: str | os.PathLike[str],
    *,
    out: str | os.PathLike[str] | None = None,
    public_key: str | os.PathLike[str] | None = None,
    storage_options: Mapping[str, Any] | None = None,
    limit: int | None = None,
) -> tuple[Path, RunFacts]:
    """Check the run at ``run_dir`` and write its report (default ``RUN_DIR/report.html``); returns (path, facts).

    ``storage_options`` reach the run's bucket (default: those its ``config.yaml`` records). ``limit``: show the
    newest ``limit`` checkpoints in detail, the older ones counted (every one is checked either way).
    """
    facts = collect_run(run_dir, public_key=public_key, storage_options=storage_options)
    target = Path(out) if out is not None else facts.run_dir / REPORT_FILE
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text(render_report(facts, limit=limit), encoding="utf-8")
    os.replace(tmp, target)
    return target, facts
