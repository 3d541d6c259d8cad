"""The checkpoint subcommands of ``shardline``: ``verify``, ``inspect``, ``consolidate``, ``lineage``, ``adopt``.

``register(subparsers)`` adds them to the main parser; each sets ``func`` to a handler that
returns the exit code: 0 success, 1 a check failed or the input was bad (the message names
what and why, in one line), 2 usage errors (argparse, e.g. an ``--expect`` that is not a
SHA-256). ``--json`` prints one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from shardline.checkpoint.integrity.verify import VerifyLevel
from shardline.cli.common import add_storage_options, emit_json, fail, row_count, sha256_arg, storage_options
from shardline.errors import ShardlineError, SignatureError

if TYPE_CHECKING:  # imported where used, so that the CLI starts without them
    from shardline.checkpoint.provenance.ledger import Ledger, LedgerRow, LineageReport
    from shardline.checkpoint.storage.protocol import Location

__all__ = ["register"]


def _cmd_verify(args: argparse.Namespace) -> int:
    from shardline.checkpoint.integrity.export_verify import is_export, verify_export
    from shardline.checkpoint.integrity.verify import verify_checkpoint
    from shardline.checkpoint.provenance.signing import verify_signature

    export = is_export(args.checkpoint)
    signed, sig_error = None, None
    try:
        if export:
            report = verify_export(args.checkpoint)
        else:
            report = verify_checkpoint(
                args.checkpoint,
                level=args.level,
                expected_manifest_hash=args.expect,
                storage_options=storage_options(args),
            )
        if args.public_key:
            try:
                signed = verify_signature(
                    args.checkpoint,
                    public_key=args.public_key,
                    signature=args.signature,
                    storage_options=storage_options(args),
                )
            except SignatureError as e:
                sig_error = str(e)
    except (ShardlineError, OSError) as e:
        return fail(args, e)
    ok = report.ok and sig_error is None
    if args.json:
        out = report.to_json() | {"ok": ok}
        if args.public_key:
            out["signature"] = signed.to_json() | {"ok": True} if signed else {"ok": False, "error": sig_error}
        emit_json(out)
        return 0 if ok else 1
    if report.ok:
        print(
            f"OK: {report.path} (step {report.step}): {report.files_checked} files match the "
            f"{'export record' if export else 'manifest'}"
            f"{' (hashes re-computed)' if VerifyLevel.parse(args.level) is VerifyLevel.FULL else ' (sizes only)'}; "
            f"{'source ' if export else ''}manifest hash {report.manifest_hash}"
        )
    else:
        print(f"FAILED: {report.path}", file=sys.stderr)
        for p in report.problems:
            print(f"  {p.kind:<10} {p.path}: {p.detail}", file=sys.stderr)
        if report.error:
            print(f"  {report.error}", file=sys.stderr)
    if signed is not None:
        print(f"OK: signature {signed.signature} verifies with {args.public_key} over {len(signed.files)} files.")
    elif sig_error is not None:
        print(f"FAILED: {sig_error}", file=sys.stderr)
    return 0 if ok else 1


def _cmd_inspect(args: argparse.Namespace) -> int:
    from shardline.checkpoint.lifecycle.summary import render_summary, summarize

    try:
        summary = summarize(args.checkpoint, storage_options=storage_options(args))
    except (ShardlineError, OSError) as e:
        return fail(args, e)
    if args.json:
        emit_json(summary)
    else:
        print(render_summary(summary))
    return 0


def _cmd_consolidate(args: argparse.Namespace) -> int:
    from shardline.checkpoint.lifecycle.consolidate import consolidate
    from shardline.checkpoint.lifecycle.summary import human_bytes

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = consolidate(
                args.checkpoint,
                args.out,
                max_shard_size=args.max_shard_size,
                dtype=args.dtype,
                verify=args.verify,
                expected_manifest_hash=args.expect,
                adapters=args.adapters,
                storage_options=storage_options(args),
            )
    except (ShardlineError, OSError) as e:
        return fail(args, e)
    for w in caught:
        if "torch.distributed is disabled" not in str(w.message):
            print(f"warning: {w.message}", file=sys.stderr)
    if args.json:
        emit_json(
            {
                "ok": True,
                "out": str(result.out),
                "files": list(result.files),
                "tensors": result.tensors,
                "total_bytes": result.total_bytes,
                "source_manifest_sha256": result.source_manifest_hash,
                "step": result.step,
                "aliases": result.aliases,
                "note": result.note,
                "verified": result.verified,
            }
        )
        return 0
    weights = [f for f in result.files if f["path"].endswith(".safetensors")]
    print(
        f"Wrote {result.tensors} tensors from step {result.step} as {len(weights)} safetensors file(s), "
        f"{human_bytes(result.total_bytes)} in all, to {result.out}."
    )
    if result.aliases:
        print(f"Tied parameters written once: {', '.join(f'{a} = {b}' for a, b in result.aliases.items())}.")
    if result.note:
        print(f"{result.note}.")
    if result.out.is_dir():
        print(f"Source manifest hash {result.source_manifest_hash} and output hashes are in consolidation.json.")
    else:
        print(f"Source manifest hash {result.source_manifest_hash} is in the file's safetensors metadata.")
    return 0


def _cmd_lineage(args: argparse.Namespace) -> int:
    from shardline.checkpoint.provenance.best import best_marks
    from shardline.checkpoint.provenance.ledger import Ledger
    from shardline.checkpoint.provenance.lineage import (
        audit,
        check_stores,
        checkpoint_directories,
        describe_event,
        find_ledger,
        note_row,
    )
    from shardline.checkpoint.provenance.records import adoption
    from shardline.checkpoint.provenance.retention import record_deletions
    from shardline.checkpoint.provenance.statement import chain_statements
    from shardline.checkpoint.storage.stores import local_path
    from shardline.train.records import recorded_checkpoint_dirs, run_storage_options

    if local_path(args.run_dir) is None and args.ledger is None:
        print(
            f"error: {args.run_dir} is an object-store prefix; the ledger of its checkpoints stays in the run "
            f"directory: pass it, `shardline lineage {args.run_dir} --ledger RUN_DIR/lineage.sqlite`, or check the "
            "whole run with `shardline lineage RUN_DIR`",
            file=sys.stderr,
        )
        return 2
    try:
        found = find_ledger(args.ledger or args.run_dir)
        options = storage_options(args)
        ledger = Ledger(found, storage_options=run_storage_options(found.parent, options))
        also = [args.run_dir] if args.ledger else []
        dirs = checkpoint_directories(ledger, also=[*also, *recorded_checkpoint_dirs(ledger.path.parent)])
        if args.record_deletions:
            check_stores(dirs)  # an unreachable bucket is not a deletion
            recorded = record_deletions(ledger)
            print(f"Recorded {len(recorded)} deletion(s) with tombstone rows.", file=sys.stderr)
        report = audit(ledger, directories=dirs, check_checkpoints=not args.no_check_checkpoints)
        if args.new_chain:
            return _new_chain(args, ledger, report)
        shown = _page(report.rows, since=args.since, limit=args.limit)  # the chain is verified whole regardless
        statements = (
            chain_statements(ledger.path.parent, shown, storage_options=ledger.storage_options) if args.json else {}
        )
    except (ShardlineError, OSError) as e:
        return fail(args, e)
    best = best_marks(report.rows)  # the checkpoints the run's best-k retention keeps as best
    paged = len(shown) < len(report.rows)
    if args.json:
        out = report.to_json()
        out["rows"] = [r.to_json() for r in shown]
        out["rows_total"] = len(report.rows)
        if not args.no_check_checkpoints:
            out["checked"] = [_checked(d) for d in dirs]
        for row in out["rows"]:
            if row["seq"] in statements:
                row["provenance"] = statements[row["seq"]]
            if row["seq"] in best:
                ranked, policy = best[row["seq"]]
                row["kept_as_best"] = {"place": ranked.place, "monitor": policy.monitor, "value": ranked.value}
        emit_json(out)
        return 0 if report.ok else 1
    commits = sum(1 for r in report.rows if r.is_commit)
    print(f"Lineage ledger {report.path}: {commits} committed checkpoint(s), {len(report.rows) - commits} event(s)")
    if paged:
        print(
            f"  showing {len(shown)} of {len(report.rows)} rows"
            + (f" (#{shown[0].seq} to #{shown[-1].seq})" if shown else f" (none from #{args.since} on)")
            + "; the whole chain is verified"
        )
    for row in shown:
        if not row.is_commit:
            print(f"  #{row.seq:<3} {row.event}: {describe_event(row)}  row {row.row_sha256[:12]}  {row.committed_at}")
            continue
        parent = (row.parent_manifest_sha256 or "-")[:12]
        flags = " (recovered after a crash)" if row.recovered else ""
        if adoption(row) is not None:
            flags += " (adopted: written by another tool, hashes taken after the fact)"
        if row.seq in best:
            ranked, policy = best[row.seq]
            flags += f" (kept as best #{ranked.place} of {policy.keep_best_k}: {policy.monitor}={ranked.value:.6g})"
        tag = f" [{row.tag}]" if row.tag else ""
        print(
            f"  #{row.seq:<3} step {row.step:>9,}{tag}  {row.checkpoint}  manifest {row.manifest_sha256[:12]}  "
            f"parent {parent}  row {row.row_sha256[:12]}  {row.committed_at}{flags}"
        )
    first = shown[0].seq if shown else len(report.rows) + 1
    earlier = {n for n in report.notes if paged and 0 < note_row(n) < first}
    for note in report.notes:
        if note not in earlier:
            print(f"  note: {note}")
    if earlier:
        print(f"  ({len(earlier)} note(s) about rows before those shown are left out; --json lists every note)")
    if report.ok:
        print(
            "Chain verified: every row hash and link matches"
            + (
                ""
                if args.no_check_checkpoints
                else ", every checkpoint on disk"
                + "".join(sorted({f" and {p}" for p in _places(dirs)} - {" and on disk"}))
                + " matches its recorded manifest hash, and every committed checkpoint in "
                + " and ".join(_checked(d)["where"] for d in dirs)
                + " is in the chain"
            )
            + "."
        )
        return 0
    print(f"Chain BROKEN: {report.problems[0]}", file=sys.stderr)
    for problem in report.problems[1:]:
        print(f"  {problem}", file=sys.stderr)
    print(
        f"  To continue: restore the ledger from a backup, or `shardline lineage {args.run_dir} --new-chain` keeps "
        "this ledger aside and starts a new chain whose first row records the break.",
        file=sys.stderr,
    )
    return 1


def _page(rows: Sequence[LedgerRow], *, since: int | None, limit: int | None) -> Sequence[LedgerRow]:
    """The rows ``lineage`` prints: from sequence number ``since`` on, the newest ``limit`` of them (rows are in
    append order)."""
    if since is not None:
        rows = [r for r in rows if r.seq >= since]
    return rows[-limit:] if limit is not None else rows


def _cmd_adopt(args: argparse.Namespace) -> int:
    from shardline.checkpoint.lifecycle.adopt import ADOPTED_HASHES, adopt
    from shardline.checkpoint.lifecycle.summary import human_bytes

    try:
        done = adopt(
            args.checkpoint,
            step=args.step,
            ledger=args.ledger,
            storage_options=storage_options(args),
            subfolders=args.subfolders,
        )
    except (ShardlineError, OSError) as e:
        return fail(args, e)
    if args.json:
        emit_json(
            {
                "ok": True,
                "path": str(done.path),
                "step": done.step,
                "manifest_sha256": done.manifest_hash,
                "world_size": done.world_size,
                "files": done.files,
                "total_bytes": done.total_bytes,
                "extra_files": list(done.extra_files),
                "ledger": str(done.ledger) if done.ledger else None,
                "hashes": ADOPTED_HASHES,
            }
        )
        return 0
    print(
        f"Adopted {done.path} as step {done.step}: {done.files} files, {human_bytes(done.total_bytes)}, every chunk "
        f"its .metadata records present; manifest hash {done.manifest_hash}; recorded in {done.ledger}."
    )
    if done.extra_files:
        print(f"Files .metadata does not name, hashed and listed too: {', '.join(done.extra_files)}.")
    print(f"Its hashes were {ADOPTED_HASHES}.")
    return 0


def _checked(directory: Location) -> dict[str, Any]:
    """A place ``lineage`` listed for committed checkpoints, for its messages and ``--json`` (``checked``)."""
    from shardline.checkpoint.storage.stores import local_path, store_for

    where = store_for(directory).describe_directory(directory)
    return {"where": where, "location": str(directory), "store": local_path(directory) is None}


def _places(locations: Iterable[Location | str]) -> set[str]:
    """Where ``locations`` are, as messages say it (``on disk``, ``in the object store``)."""
    from shardline.checkpoint.storage.stores import store_for

    return {store_for(where).place for where in locations}


def _new_chain(args: argparse.Namespace, ledger: Ledger, report: LineageReport) -> int:
    from shardline.checkpoint.provenance.lineage import start_new_chain

    if report.ok:
        print(f"error: the ledger {ledger.path} verifies; there is no break to record", file=sys.stderr)
        return 1
    aside, rows = start_new_chain(ledger, problems=list(report.problems))
    if args.json:
        emit_json({"ok": True, "previous_ledger": str(aside), "rows": [r.to_json() for r in rows]})
        return 0
    print(
        f"Kept the broken ledger as {aside}; started a new chain in {ledger.path}: its first row "
        f"({rows[0].row_sha256[:12]}) records the break, then {len(rows) - 1} committed checkpoint(s) "
        + " and ".join(["on disk", *sorted(_places(r.checkpoint for r in rows) - {"on disk"})])
        + " are recorded again (marked recovered). Training can append to it."
    )
    return 0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``verify``, ``inspect``, ``consolidate``, ``lineage`` and ``adopt`` to the ``shardline`` command."""
    verify = subparsers.add_parser(
        "verify", help="check every file of a checkpoint against its manifest (exit 1 naming any mismatch)"
    )
    verify.add_argument(
        "checkpoint", help="checkpoint directory (e.g. run/checkpoints/step-100), or an export directory of one"
    )
    verify.add_argument(
        "--level",
        choices=[level.value for level in VerifyLevel if level is not VerifyLevel.NONE],
        default=VerifyLevel.FULL.value,
        help="full: re-hash every file (default); sizes: sizes only",
    )
    verify.add_argument(
        "--expect", metavar="SHA256", type=sha256_arg, help="also require this manifest hash (e.g. from the ledger)"
    )
    verify.add_argument(
        "--public-key",
        metavar="PUB.pem",
        help="also check the model-signing signature (from `shardline sign`) with this public key; needs [signing]",
    )
    verify.add_argument(
        "--signature",
        metavar="PATH",
        help="the signature file (default: CHECKPOINT.sig beside the directory or prefix)",
    )
    verify.add_argument("--json", action="store_true", help="machine-readable output")
    add_storage_options(verify)
    verify.set_defaults(func=_cmd_verify)

    inspect = subparsers.add_parser("inspect", help="describe a checkpoint in plain words")
    inspect.add_argument("checkpoint")
    inspect.add_argument("--json", action="store_true", help="machine-readable output")
    add_storage_options(inspect)
    inspect.set_defaults(func=_cmd_inspect)

    cons = subparsers.add_parser("consolidate", help="export the model weights as safetensors (HF layout)")
    cons.add_argument("checkpoint")
    cons.add_argument(
        "out", help="new output directory, or a new FILE.safetensors (one file; a directory with --max-shard-size)"
    )
    cons.add_argument(
        "--adapters",
        action="store_true",
        help="export the PEFT adapter (adapter_model.safetensors + adapter_config.json) instead of the model",
    )
    cons.add_argument(
        "--max-shard-size", metavar="SIZE", help="split into shards of at most SIZE (e.g. 5GB) with an index"
    )
    cons.add_argument("--dtype", help="cast floating-point weights (bf16, fp16, fp32)")
    cons.add_argument(
        "--verify",
        choices=[level.value for level in VerifyLevel],
        default=VerifyLevel.FULL.value,
        help="check the checkpoint first: full (default: every byte); sizes, none: opt-ins, recorded in the output",
    )
    cons.add_argument("--expect", metavar="SHA256", type=sha256_arg, help="require this source manifest hash")
    cons.add_argument("--json", action="store_true", help="machine-readable output")
    add_storage_options(cons)
    cons.set_defaults(func=_cmd_consolidate)

    lineage = subparsers.add_parser("lineage", help="print and verify a run's hash-chained checkpoint ledger")
    lineage.add_argument(
        "run_dir",
        help="run directory (or checkpoints directory, or the ledger file); with --ledger, a checkpoints directory "
        "or object-store prefix (s3://BUCKET/PREFIX) to list as well",
    )
    lineage.add_argument(
        "--ledger",
        metavar="LEDGER",
        help="the ledger (RUN_DIR/lineage.sqlite, or its run directory) when RUN_DIR names a checkpoints prefix "
        "in an object store, which holds none",
    )
    lineage.add_argument(
        "--no-check-checkpoints", action="store_true", help="only check the chain, not the checkpoints on disk"
    )
    lineage.add_argument(
        "--new-chain",
        action="store_true",
        help="if the chain does not verify: keep the ledger aside and start a new one that records the break",
    )
    lineage.add_argument(
        "--record-deletions",
        action="store_true",
        help="append a tombstone row for each recorded checkpoint deleted by hand (gone from disk without one)",
    )
    lineage.add_argument(
        "--limit",
        metavar="N",
        type=row_count,
        help="print only the newest N rows (of those --since selects); the whole chain is still verified",
    )
    lineage.add_argument(
        "--since",
        metavar="SEQ",
        type=row_count,
        help="print only the rows from sequence number SEQ on (#SEQ in the listing); the whole chain is still verified",
    )
    lineage.add_argument(
        "--json", action="store_true", help="machine-readable output, with each checkpoint's provenance statement"
    )
    add_storage_options(lineage)
    lineage.set_defaults(func=_cmd_lineage)

    adopt = subparsers.add_parser(
        "adopt", help="bring a DCP checkpoint written by another tool under lineage (manifest, hashes, ledger row)"
    )
    adopt.add_argument(
        "checkpoint", help="the directory a torch.distributed.checkpoint save wrote (or an s3://BUCKET/PREFIX)"
    )
    adopt.add_argument(
        "--step", type=int, metavar="N", help="the training step to record (default: from the name, step-N)"
    )
    adopt.add_argument(
        "--ledger",
        metavar="LEDGER",
        help="the ledger to record it in (a lineage.sqlite file, or the run directory holding one; default: "
        "lineage.sqlite beside the checkpoint; required for an object-store prefix)",
    )
    adopt.add_argument(
        "--subfolders",
        action="store_true",
        help="the DCP checkpoints are in its subfolders, beside loose files (a Hugging Face Trainer's checkpoint-N "
        "under FSDP: pytorch_model_fsdp_0/, optimizer_0/, trainer_state.json...); every file is hashed",
    )
    adopt.add_argument("--json", action="store_true", help="machine-readable output")
    add_storage_options(adopt)
    adopt.set_defaults(func=_cmd_adopt)
