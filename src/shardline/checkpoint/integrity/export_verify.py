"""Check an export directory written by ``shardline consolidate`` against its ``consolidation.json``.

An export directory holds the safetensors files (and ``config.json``, an index, adapter files...),
``consolidation.json`` (canonical JSON: the source checkpoint's manifest hash and every output
file's size and SHA-256) and ``SHA256SUMS`` (those files plus ``consolidation.json``). The check
is the export's counterpart of :func:`~.verify.verify_checkpoint`: every listed file present with
its size and SHA-256, ``SHA256SUMS`` as the sidecar implies it, nothing else in the directory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TypedDict

from shardline.checkpoint.format.canonical import canonical_json, sha256_hex
from shardline.checkpoint.integrity.verify import FileProblem, VerifyLevel, VerifyReport, check_files

__all__ = ["EXPORT_FORMAT", "SIDECAR", "is_export", "verify_export"]

SIDECAR = "consolidation.json"
EXPORT_FORMAT = "shardline.consolidation"
_SUMS = "SHA256SUMS"


def is_export(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is an export directory (it holds ``consolidation.json``)."""
    return (Path(path) / SIDECAR).is_file()


class _Where(TypedDict):
    """What every report of :func:`verify_export` starts with."""

    path: str
    level: str


def verify_export(path: str | os.PathLike[str]) -> VerifyReport:
    """Every file of the export at ``path`` against ``consolidation.json`` (sizes and SHA-256), and nothing extra.

    ``manifest_hash`` of the report is the *source checkpoint's* manifest hash the sidecar records.
    """
    root = Path(path)
    base: _Where = {"path": str(root), "level": VerifyLevel.FULL.value}
    file = root / SIDECAR
    if not file.is_file():
        return VerifyReport(**base, manifest_hash=None, step=None, files_checked=0, bytes_checked=0,
                            error=f"{root} is not a shardline export: it has no {SIDECAR}")  # fmt: skip
    raw = file.read_bytes()
    try:
        sidecar = json.loads(raw.decode("utf-8"))
        ok = isinstance(sidecar, dict) and sidecar.get("format") == EXPORT_FORMAT and canonical_json(sidecar) == raw
        entries = sidecar["files"] if ok else []
        ok = ok and all(isinstance(e, dict) and {"path", "bytes", "sha256"} <= e.keys() for e in entries)
    except Exception:
        ok, sidecar, entries = False, {}, []
    if not ok:
        problem = FileProblem(SIDECAR, "altered", "not the canonical JSON of a shardline export record")
        return VerifyReport(**base, manifest_hash=None, step=None, files_checked=1, bytes_checked=len(raw),
                            problems=(problem,), error="the export record cannot be trusted")  # fmt: skip
    problems, read = check_files(root, entries, VerifyLevel.FULL)
    rows = {str(e["path"]): str(e["sha256"]) for e in entries} | {SIDECAR: sha256_hex(raw)}
    wanted = "".join(f"{h}  {n}\n" for n, h in sorted(rows.items())).encode()
    sums = root / _SUMS
    if not sums.is_file():
        problems.append(FileProblem(_SUMS, "missing", f"derived from {SIDECAR}; should be present"))
    elif sums.read_bytes() != wanted:
        problems.append(FileProblem(_SUMS, "altered", f"does not match the hashes {SIDECAR} records"))
    expected = set(rows) | {_SUMS}
    for child in sorted(root.iterdir()):
        if child.name not in expected:
            problems.append(FileProblem(child.name, "unexpected", f"not listed in {SIDECAR}"))
    source = sidecar.get("source") or {}
    return VerifyReport(
        **base,
        manifest_hash=source.get("manifest_sha256"),
        step=source.get("step"),
        files_checked=len(entries) + 2,
        bytes_checked=read + len(raw),
        problems=tuple(problems),
    )
