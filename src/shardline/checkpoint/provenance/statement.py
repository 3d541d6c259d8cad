"""The provenance statement of a checkpoint: an in-toto Statement v1 saying where its files came from.

Every checkpoint saved by shardline holds ``provenance.intoto.json``, written by rank 0 in the
save's temporary directory after the data files, with the manifest::

    {"_type": "https://in-toto.io/Statement/v1",
     "subject": [{"name": "manifest.json", "digest": {"sha256": "<the manifest hash>"}}],
     "predicateType": "https://github.com/shardline/shardline/blob/main/docs/provenance.md#checkpoint-provenance-v1",
     "predicate": {"checkpoint": {...}, "training_config": {...}, "data": {...}, "parent": {...},
                   "code": {...}, "runtime": {...}, "distributed": {...}}}

Note: why the statement names the manifest, not every file. Its subject is ``manifest.json``
by its SHA-256 (the manifest hash), and the manifest names every data file by its SHA-256, so
the statement covers the weights through one hash. Until this form, the statement listed every
data file as a subject and the manifest listed the statement: at 16,384 ranks x 8 files rank 0
built, checked and encoded the 131k-file list twice (1.5 s of the commit, a 15 MB statement
copied into the ledger). A statement names the manifest, so the manifest cannot list it; it is
a derived record like ``SHA256SUMS``, which lists it (``sha256sum -c SHA256SUMS`` checks it with
everything else), committed by the same rename or with the same records as the manifest, and
the ledger's commit row records its SHA-256 (that, and a signature of the directory, pin it; the
manifest hash no longer does). Statements of the earlier form -- per-file subjects, listed in
the manifest -- are read and verified as they were (:func:`statement_problems` handles both).

The statement is canonical JSON (sorted keys, no whitespace, no floats), like the manifest;
floats of the resolved training config are written ``{"$float": "0.001"}``, the form the
config fingerprint hashes, so ``predicate.training_config.sha256`` can be recomputed from the
statement alone (docs/provenance.md shows how).
"""

from __future__ import annotations

import functools
import json
import os
import platform
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from shardline._version import __version__
from shardline.checkpoint.format.canonical import canonical_json, manifest_hash, sha256_hex, tag_floats
from shardline.checkpoint.integrity.manifest import STATEMENT_FILE, named_manifest
from shardline.checkpoint.storage.protocol import COMMIT_RECORD, Location
from shardline.checkpoint.storage.stores import locate
from shardline.errors import IntegrityError

__all__ = [
    "PREDICATE_TYPE",
    "STATEMENT_FILE",
    "STATEMENT_TYPE",
    "build_statement",
    "code_version",
    "git_commit",
    "named_manifest",
    "read_statement",
    "statement_problems",
]

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://github.com/shardline/shardline/blob/main/docs/provenance.md#checkpoint-provenance-v1"
_SHA = re.compile(r"^[0-9a-f]{40}(?:[0-9a-f]{24})?$")


def _git_dir(root: Path) -> Path | None:
    dotgit = root / ".git"
    if dotgit.is_dir():
        return dotgit
    if dotgit.is_file():  # a worktree or submodule: "gitdir: <path>"
        text = dotgit.read_text(encoding="utf-8", errors="replace").strip()
        if text.startswith("gitdir:"):
            target = Path(text.removeprefix("gitdir:").strip())
            return target if target.is_absolute() else (root / target).resolve()
    return None


def _resolve_ref(git_dir: Path, ref: str) -> str | None:
    common = git_dir
    if (git_dir / "commondir").is_file():
        text = (git_dir / "commondir").read_text(encoding="utf-8").strip()
        common = Path(text) if Path(text).is_absolute() else (git_dir / text).resolve()
    for base in (git_dir, common):
        loose = base / ref
        if loose.is_file():
            value = loose.read_text(encoding="utf-8").strip()
            return value if _SHA.match(value) else None
    packed = common / "packed-refs"
    if packed.is_file():
        for line in packed.read_text(encoding="utf-8").splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1] == ref and _SHA.match(parts[0]):
                return parts[0]
    return None


def git_commit(start: str | Path) -> tuple[str, Path] | None:
    """``(commit, repository root)`` of the git checkout holding ``start``, read from ``.git`` (no git, no network).

    Follows worktree/submodule ``.git`` files, loose refs and ``packed-refs``; None outside a
    checkout or when HEAD cannot be resolved.
    """
    path = Path(start).resolve()
    for root in (path, *path.parents):
        git_dir = _git_dir(root)
        if git_dir is None:
            continue
        try:
            head = (git_dir / "HEAD").read_text(encoding="utf-8").strip()
            if _SHA.match(head):
                return head, root
            if head.startswith("ref:"):
                commit = _resolve_ref(git_dir, head.removeprefix("ref:").strip())
                return (commit, root) if commit else None
        except OSError:
            return None
        return None
    return None


def _dirty(root: Path) -> bool | None:
    """Whether tracked files differ from the commit (``git status``, local only); None when git is unavailable."""
    git = shutil.which("git")
    if git is None:
        return None
    try:
        done = subprocess.run(
            [git, "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return bool(done.stdout.strip()) if done.returncode == 0 else None


@functools.lru_cache(maxsize=1)
def code_version() -> dict[str, Any]:
    """The code that runs: shardline's version and, from a git checkout of it, the commit (cached per process).

    ``git_commit`` is None for an installed package (no checkout); ``git_dirty`` says whether
    tracked files were modified (None when ``git`` is not installed).
    """
    found = git_commit(Path(__file__).parent)
    out: dict[str, Any] = {"name": "shardline", "version": __version__, "git_commit": None, "git_dirty": None}
    if found is not None:
        out["git_commit"], root = found
        out["git_dirty"] = _dirty(root)
    return out


def _torch_version() -> str:
    return str(torch.__version__).split("+")[0]


def _strategy(units: Sequence[Mapping[str, Any]]) -> str | None:
    names = sorted({str(u["strategy"]) for u in units})
    if not names:
        return None
    return names[0] if len(names) == 1 else "mixed"


def build_statement(
    *,
    manifest_sha256: str,
    step: int,
    tag: str | None,
    kind: str,
    created_at: str,
    config: Mapping[str, Any] | None,
    config_sha256: str | None,
    data_fingerprint: str | None,
    parent_manifest_sha256: str | None,
    world_size: int,
    units: Sequence[Mapping[str, Any]],
    run_tags: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The in-toto Statement v1 of the checkpoint whose manifest hashes to ``manifest_sha256`` (its one subject).

    Non-empty ``run_tags`` are recorded as ``predicate.run_tags`` (statements without them stay as before).
    """
    predicate: dict[str, Any] = {
        "checkpoint": {"step": int(step), "tag": tag, "state_dict_kind": kind, "created_at": created_at},
        "training_config": {
            "sha256": config_sha256,
            "resolved": tag_floats(dict(config)) if config is not None else None,
            "floats": 'written {"$float": repr(x)}; sha256 is that of the canonical JSON of "resolved"',
        },
        "data": {"fingerprint": data_fingerprint},
        "parent": {"manifest_sha256": parent_manifest_sha256},
        "code": code_version(),
        "runtime": {"torch": _torch_version(), "python": platform.python_version()},
        "distributed": {
            "world_size": int(world_size),
            "strategy": _strategy(units),
            "strategies": {str(u["name"]) or "<root>": str(u["strategy"]) for u in units},
        },
    }
    if run_tags:
        predicate["run_tags"] = dict(run_tags)
    return {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": COMMIT_RECORD, "digest": {"sha256": str(manifest_sha256)}}],
        "predicateType": PREDICATE_TYPE,
        "predicate": predicate,
    }


def read_statement(path: str | os.PathLike[str] | Location) -> tuple[dict[str, Any], str] | None:
    """``(statement, its sha256)`` from the checkpoint directory ``path``; None when it has none (older saves).

    Raises:
        IntegrityError: the file is not the canonical JSON of an in-toto statement of this predicate type.
    """
    file = locate(path) / STATEMENT_FILE  # a local directory, or a prefix in an object store
    if not file.is_file():
        return None
    raw = file.read_bytes()
    try:
        statement = json.loads(raw.decode("utf-8"))
        canonical = canonical_json(statement) == raw
    except Exception as e:
        raise IntegrityError(f"{file} is damaged: not canonical UTF-8 JSON ({e})") from None
    if not canonical or not isinstance(statement, dict):
        raise IntegrityError(f"{file} is altered: it is not the canonical JSON shardline writes")
    if statement.get("_type") != STATEMENT_TYPE or statement.get("predicateType") != PREDICATE_TYPE:
        raise IntegrityError(
            f"{file} is not a shardline provenance statement (_type {statement.get('_type')!r}, predicateType "
            f"{statement.get('predicateType')!r})"
        )
    return statement, sha256_hex(raw)


def statement_problems(
    statement: Mapping[str, Any], manifest: Mapping[str, Any], *, manifest_sha256: str | None = None
) -> list[str]:
    """Where a statement disagrees with its checkpoint's manifest (subjects, parent, config and data fingerprints).

    A statement naming the manifest must name this one (``manifest_sha256``, computed when not given); one of the
    earlier form must list exactly the manifest's data files.
    """
    problems: list[str] = []
    subject = statement.get("subject")
    names_manifest = isinstance(subject, list) and [s.get("name") for s in subject if isinstance(s, dict)] == [
        COMMIT_RECORD
    ]
    if names_manifest:
        listed = {COMMIT_RECORD: manifest_sha256 or manifest_hash(manifest)}
    else:
        listed = {str(f["path"]): str(f["sha256"]) for f in manifest.get("files", []) if f["path"] != STATEMENT_FILE}
    try:
        subjects = {str(s["name"]): str(s["digest"]["sha256"]) for s in statement["subject"]}
        predicate = statement["predicate"]
        pairs = (
            ("parent manifest hash", predicate["parent"]["manifest_sha256"], manifest.get("parent_manifest_sha256")),
            ("config fingerprint", predicate["training_config"]["sha256"], manifest.get("config_sha256")),
            ("data fingerprint", predicate["data"]["fingerprint"], manifest.get("data_fingerprint")),
            ("step", predicate["checkpoint"]["step"], manifest.get("step")),
        )
    except (KeyError, TypeError) as e:
        return [f"{STATEMENT_FILE} lacks a required field ({e})"]
    if subjects != listed:
        differ = sorted(set(subjects.items()) ^ set(listed.items()))
        problems.append(
            f"{STATEMENT_FILE} subjects differ from {'the manifest hash' if names_manifest else 'the manifest files'} "
            f"({', '.join(n for n, _ in differ)})"
        )
    for what, said, recorded in pairs:
        if said != recorded:
            problems.append(f"{STATEMENT_FILE} records {what} {said!r}, the manifest {recorded!r}")
    return problems


def chain_statements(
    base: Path,
    rows: Sequence[Any],
    *,
    storage_options: Mapping[str, Any] | None = None,
    located: Callable[[str], Location] | None = None,
) -> dict[int, dict[str, Any]]:
    """The provenance statement of every commit row of a ledger (``base``: the ledger's directory), by row ``seq``.

    ``storage_options`` reach the object store of rows that name a checkpoint by URL. ``located``: where a
    row's checkpoint is (the ledger's ``locate``, which builds each location once), default: built here.

    Each entry: ``statement`` (or None), ``sha256``, ``source`` (``"checkpoint"`` when read from
    the directory, ``"tombstone"`` when the checkpoint was deleted and its tombstone row kept a
    copy, ``None`` when there is none), and ``matches_ledger``: whether its SHA-256 is the one the
    commit row records (None when the row records none, e.g. checkpoints saved before statements).
    """
    kept: dict[tuple[str, str], dict[str, Any]] = {}
    for row in rows:
        if row.event == "tombstone" and row.detail:
            detail = json.loads(row.detail)
            if isinstance(detail.get("provenance"), dict):
                kept[(row.checkpoint, row.manifest_sha256)] = detail
    out: dict[int, dict[str, Any]] = {}
    for row in rows:
        if not row.is_commit or not row.checkpoint:
            continue
        recorded = (json.loads(row.detail).get("provenance") or {}).get("sha256") if row.detail else None
        entry: dict[str, Any] = {"statement": None, "sha256": None, "source": None, "matches_ledger": None}
        copy = kept.get((row.checkpoint, row.manifest_sha256))
        where = (
            located(row.checkpoint)
            if located is not None
            else locate(row.checkpoint, storage_options=storage_options, relative_to=base)
        )
        if copy is not None:
            entry.update(statement=copy["provenance"], sha256=sha256_hex(canonical_json(copy["provenance"])))
            entry["source"] = "tombstone"
        elif where.is_dir():
            try:
                found = read_statement(where)
            except IntegrityError as e:
                entry["problem"] = str(e)
                found = None
            if found is not None:
                entry.update(statement=found[0], sha256=found[1], source="checkpoint")
        if recorded is not None and entry["sha256"] is not None:
            entry["matches_ledger"] = entry["sha256"] == recorded
        out[row.seq] = entry
    return out
