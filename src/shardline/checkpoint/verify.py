"""Check a checkpoint directory against its manifest: missing, altered and unexpected files.

Levels: ``manifest`` (the manifest hash, every file present with its recorded size, the
derived files, nothing unexpected) and ``full`` (also re-hash every file). Nothing here
imports torch's checkpoint machinery: a reviewer's check is plain file hashing.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from shardline.checkpoint.canonical import canonical_json
from shardline.checkpoint.hashing import sha256_file
from shardline.checkpoint.manifest import (
    DCP_METADATA,
    FORMAT,
    MANIFEST,
    MANIFEST_HASH_FILE,
    SUMS_FILE,
    manifest_files,
    render_manifest_hash_file,
    render_sums,
)
from shardline.errors import ConfigurationError

__all__ = ["FileProblem", "VerifyLevel", "VerifyReport", "check_files", "verify_checkpoint"]

VerifyLevel = Literal["manifest", "full"]


@dataclass(frozen=True)
class FileProblem:
    """One file that does not match: ``kind`` is ``missing``, ``altered`` or ``unexpected``."""

    path: str
    kind: str
    detail: str

    def to_json(self) -> dict[str, str]:
        return {"path": self.path, "problem": self.kind, "detail": self.detail}


@dataclass(frozen=True)
class VerifyReport:
    """Outcome of :func:`verify_checkpoint`. ``ok`` is True only when there is no problem at all."""

    path: str
    level: str
    manifest_hash: str | None
    step: int | None
    files_checked: int
    bytes_checked: int
    problems: tuple[FileProblem, ...] = field(default_factory=tuple)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and not self.problems

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "ok": self.ok,
            "level": self.level,
            "manifest_sha256": self.manifest_hash,
            "step": self.step,
            "files_checked": self.files_checked,
            "bytes_checked": self.bytes_checked,
            "problems": [p.to_json() for p in self.problems],
            "error": self.error,
        }


def check_files(root: Path, entries: Sequence[Mapping[str, Any]], level: str) -> tuple[list[FileProblem], int]:
    """Problems of the listed files under ``root`` (size; and SHA-256 at level ``full``), and bytes read."""
    problems: list[FileProblem] = []
    read = 0
    for entry in entries:
        name, size, digest = str(entry["path"]), int(entry["bytes"]), str(entry["sha256"])
        file = root / name
        if not file.is_file():
            problems.append(FileProblem(name, "missing", f"listed in the manifest ({size} bytes) but not present"))
            continue
        actual_size = file.stat().st_size
        if actual_size != size:
            problems.append(FileProblem(name, "altered", f"size {actual_size} bytes, manifest records {size}"))
            continue
        if level == "full":
            _, actual = sha256_file(file)
            read += size
            if actual != digest:
                problems.append(FileProblem(name, "altered", f"sha256 {actual}, manifest records {digest}"))
    return problems, read


def _recorded(path: Path) -> str | None:
    try:
        parts = (path / MANIFEST_HASH_FILE).read_text(encoding="ascii").split()
    except (OSError, UnicodeDecodeError):
        return None
    return parts[0] if len(parts) == 2 and parts[1] == MANIFEST else None


def _sums_manifest_line(path: Path) -> str | None:
    try:
        for line in (path / SUMS_FILE).read_text(encoding="utf-8").splitlines():
            digest, _, name = line.partition("  ")
            if name == MANIFEST:
                return digest
    except (OSError, UnicodeDecodeError):
        return None
    return None


def _unexpected(path: Path, expected: set[str]) -> list[FileProblem]:
    out = []
    for child in sorted(path.iterdir()):
        if child.name not in expected:
            what = "directory" if child.is_dir() else f"{child.stat().st_size} bytes"
            out.append(FileProblem(child.name, "unexpected", f"not listed in the manifest ({what})"))
    return out


def verify_checkpoint(
    path: str | os.PathLike, *, level: VerifyLevel = "full", expected_manifest_hash: str | None = None
) -> VerifyReport:
    """Check every file of the checkpoint at ``path`` against its manifest.

    The report names each missing, altered or unexpected file. ``expected_manifest_hash`` (e.g.
    from the lineage ledger or a release note) additionally pins the manifest itself: without
    it, a consistent rewrite of manifest, hashes and data cannot be told from the original.
    """
    if level not in ("manifest", "full"):
        raise ConfigurationError(f"verification level must be 'manifest' or 'full', got {level!r}")
    root = Path(path)
    base = {"path": str(root), "level": level}
    if not root.is_dir():
        return VerifyReport(**base, manifest_hash=None, step=None, files_checked=0, bytes_checked=0,
                            error=f"{root} is not a checkpoint: no such directory")  # fmt: skip
    manifest_file = root / MANIFEST
    if not manifest_file.is_file():
        if (root / DCP_METADATA).is_file():
            error = (
                f"{root} is a plain torch.distributed.checkpoint directory without a shardline manifest: it has "
                "no lineage and no recorded hashes, so it cannot be verified"
            )
        else:
            error = f"{root} is not a checkpoint: it has neither {MANIFEST} nor {DCP_METADATA}"
        return VerifyReport(**base, manifest_hash=None, step=None, files_checked=0, bytes_checked=0, error=error)

    raw = manifest_file.read_bytes()
    actual = hashlib.sha256(raw).hexdigest()
    recorded = _recorded(root)
    problems: list[FileProblem] = []
    manifest: dict[str, Any] | None = None
    try:
        parsed = json.loads(raw.decode("utf-8"))
        if isinstance(parsed, dict) and parsed.get("format") == FORMAT and canonical_json(parsed) == raw:
            manifest = parsed
    except Exception:
        manifest = None
    if recorded is None:
        problems.append(
            FileProblem(
                MANIFEST_HASH_FILE,
                "missing" if not (root / MANIFEST_HASH_FILE).exists() else "altered",
                "needed to check the manifest hash",
            )
        )
    elif recorded != actual:
        # Two of three copies of the manifest hash agreeing tells which file changed.
        sums_line = _sums_manifest_line(root)
        if sums_line == actual:
            problems.append(
                FileProblem(MANIFEST_HASH_FILE, "altered", f"records {recorded}, manifest.json is {actual}")
            )
        else:
            problems.append(
                FileProblem(MANIFEST, "altered", f"sha256 {actual}, {MANIFEST_HASH_FILE} records {recorded}")
            )
    if manifest is None:
        if not any(p.path == MANIFEST for p in problems):
            problems.append(FileProblem(MANIFEST, "altered", "not the canonical JSON of a shardline manifest"))
        return VerifyReport(**base, manifest_hash=actual, step=None, files_checked=1, bytes_checked=len(raw),
                            problems=tuple(problems),
                            error="the manifest cannot be trusted, so the other files were not checked")  # fmt: skip
    if expected_manifest_hash is not None and expected_manifest_hash != actual:
        problems.append(
            FileProblem(
                MANIFEST, "altered", f"manifest hash {actual} differs from the expected {expected_manifest_hash}"
            )
        )
    try:
        entries = manifest_files(manifest)
    except Exception as e:
        problems.append(FileProblem(MANIFEST, "altered", str(e)))
        return VerifyReport(**base, manifest_hash=actual, step=manifest.get("step"), files_checked=1,
                            bytes_checked=len(raw), problems=tuple(problems))  # fmt: skip
    file_problems, read = check_files(root, entries, level)
    problems.extend(file_problems)
    for name, wanted in (
        (MANIFEST_HASH_FILE, render_manifest_hash_file(actual)),
        (SUMS_FILE, render_sums(actual, entries)),
    ):
        file = root / name
        if not file.is_file():
            if not any(p.path == name for p in problems):
                problems.append(FileProblem(name, "missing", "derived from the manifest; should be present"))
        elif file.read_bytes() != wanted and not any(p.path == name for p in problems):
            problems.append(FileProblem(name, "altered", "does not match the hashes the manifest records"))
    expected = {str(e["path"]) for e in entries} | {MANIFEST, MANIFEST_HASH_FILE, SUMS_FILE}
    problems.extend(_unexpected(root, expected))
    return VerifyReport(
        **base,
        manifest_hash=actual,
        step=manifest.get("step"),
        files_checked=len(entries) + 3,
        bytes_checked=read + len(raw),
        problems=tuple(problems),
    )
