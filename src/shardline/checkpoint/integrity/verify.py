"""Check a checkpoint directory against its manifest: missing, altered and unexpected files.

Levels (:class:`VerifyLevel`): ``full`` (the default everywhere: the manifest hash, every file
present with its recorded size and SHA-256, the derived files, nothing unexpected), ``sizes``
(the same without re-hashing the data files: an explicit opt-in that callers record and print)
and ``none`` (no file checks; loading only). Nothing here imports torch's checkpoint machinery:
a reviewer's check is plain file hashing.
"""

from __future__ import annotations

import enum
import hashlib
import json
import os
import re
import warnings
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from shardline.checkpoint.coordination.parallelism import MIN_AUTO_FILE_BYTES, available_cores
from shardline.checkpoint.format.canonical import canonical_json
from shardline.checkpoint.integrity.hashing import sha256_file
from shardline.checkpoint.integrity.manifest import (
    DCP_METADATA,
    FORMAT,
    MANIFEST,
    MANIFEST_HASH_FILE,
    STATEMENT_FILE,
    SUMS_FILE,
    manifest_files,
    named_manifest,
    read_error,
    render_manifest_hash_file,
    render_sums,
)
from shardline.checkpoint.storage.protocol import Location
from shardline.checkpoint.storage.stores import locate, store_for
from shardline.errors import ConfigurationError

__all__ = [
    "FileProblem",
    "VerifyLevel",
    "VerifyReport",
    "check_expected_hash",
    "check_files",
    "derived_and_unexpected",
    "level_argument",
    "verify_checkpoint",
]

_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class VerifyLevel(str, enum.Enum):
    """How much of a checkpoint is checked against its manifest before it is used."""

    FULL = "full"
    """Every file's size and SHA-256 (the default): nothing unverified is read."""
    SIZES = "sizes"
    """Files present with their recorded sizes, nothing unexpected, ``.metadata`` hashed; data files
    not re-hashed. An opt-in: loads record it (ledger) and say so."""
    NONE = "none"
    """No file checks (loading only: the one way to load a plain DCP directory). An opt-in, recorded."""

    @classmethod
    def parse(cls, value: VerifyLevel | str) -> VerifyLevel:
        """The level named ``value`` (``full``, ``sizes``, ``none``).

        Raises:
            ConfigurationError: an unknown name (``manifest``, the old name of ``sizes``, says so).
        """
        if isinstance(value, VerifyLevel):
            return value
        text = str(value).strip().lower()
        if text == "manifest":
            raise ConfigurationError(
                "the verification level 'manifest' is now called 'sizes' (it checks file sizes only, not their "
                "bytes); use 'full' (the default: every byte hashed) or, knowingly, 'sizes'"
            )
        try:
            return cls(text)
        except ValueError:
            raise ConfigurationError(
                f"unknown verification level {value!r}; use one of {', '.join(v.value for v in cls)}"
            ) from None

    @property
    def opt_in(self) -> bool:
        """Whether this level checks less than every byte (and so must be recorded and reported)."""
        return self is not VerifyLevel.FULL


def level_argument(level: VerifyLevel | str, verify: VerifyLevel | str | None, *, caller: str) -> VerifyLevel:
    """The level a verifier was asked for: ``level=``, or the older keyword ``verify=`` (deprecated, warns).

    Note: the verifiers (``verify_checkpoint``, ``check_checkpoint``, ``open_checkpoint``) all name their level
    ``level=``; ``verify=`` stays accepted by the latter two until the next minor release.

    Raises:
        ConfigurationError: an unknown level, or both keywords with different levels.
    """
    if verify is None:
        return VerifyLevel.parse(level)
    warnings.warn(
        f"{caller}(verify=...) is deprecated: pass level={str(getattr(verify, 'value', verify))!r} instead "
        "(verify= stops being accepted in the next minor release)",
        DeprecationWarning,
        stacklevel=3,
    )
    old, new = VerifyLevel.parse(verify), VerifyLevel.parse(level)
    if new is not VerifyLevel.FULL and new is not old:
        raise ConfigurationError(
            f"{caller} got level={new.value!r} and the older verify={old.value!r}; pass level= only"
        )
    return old


def check_expected_hash(expected: str | None, *, where: str = "the expected manifest hash") -> str | None:
    """``expected`` lower-cased if it is a SHA-256 in hex (64 hex digits), None if None.

    Raises:
        ConfigurationError: it is not 64 hex digits (the argument is wrong, not the checkpoint).
    """
    if expected is None:
        return None
    text = str(expected).strip().lower()
    if not _HEX64.match(text):
        raise ConfigurationError(
            f"{where} must be a SHA-256 in hex (64 characters 0-9a-f), got {expected!r} ({len(str(expected))} "
            "characters); copy it from `shardline lineage RUN_DIR` or `shardline inspect CKPT`"
        )
    return text


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


def check_files(
    root: Location, entries: Sequence[Mapping[str, Any]], level: VerifyLevel | str
) -> tuple[list[FileProblem], int]:
    """Problems of the listed files under ``root`` (size; and SHA-256 at level ``full``), and bytes read.

    Files are hashed on one thread per core this process may use (when they hold 16 MiB or more),
    so a checkpoint written as several files per rank is checked on several cores at once;
    problems come in listing order.
    """
    level = VerifyLevel.parse(level)

    def check(entry: Mapping[str, Any]) -> tuple[FileProblem | None, int]:
        name, size, digest = str(entry["path"]), int(entry["bytes"]), str(entry["sha256"])
        file = root / name
        missing = FileProblem(name, "missing", f"listed in the manifest ({size} bytes) but not present")
        try:
            if not file.is_file():
                return missing, 0
            actual_size = file.stat().st_size
            if actual_size != size:
                return FileProblem(name, "altered", f"size {actual_size} bytes, manifest records {size}"), 0
            if level is not VerifyLevel.FULL:
                return None, 0
            _, actual = sha256_file(file)
        except FileNotFoundError:
            return missing, 0
        except OSError as e:  # EIO, ESTALE, EACCES: the file system failed, the checkpoint is not shown damaged
            raise read_error(file, e) from e
        if actual != digest:
            return FileProblem(name, "altered", f"sha256 {actual}, manifest records {digest}"), size
        return None, size

    threads = min(len(entries), available_cores())
    if threads > 1 and sum(int(e["bytes"]) for e in entries) >= MIN_AUTO_FILE_BYTES:  # small: threads cost more
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="shardline-verify") as pool:
            futures = [pool.submit(check, entry) for entry in entries]
        outcomes = [f.result() for f in futures]
    else:
        outcomes = [check(entry) for entry in entries]
    problems = [problem for problem, _ in outcomes if problem is not None]
    return problems, sum(read for _, read in outcomes)


def _recorded(path: Location) -> str | None:
    try:
        parts = (path / MANIFEST_HASH_FILE).read_text(encoding="ascii").split()
    except (OSError, UnicodeDecodeError):
        return None
    return parts[0] if len(parts) == 2 and parts[1] == MANIFEST else None


def _sums_line(sums: bytes | None, wanted: str) -> str | None:
    """The digest ``SHA256SUMS`` (its bytes; None when absent) records for ``wanted``, or None."""
    try:
        lines = sums.decode("utf-8").splitlines() if sums is not None else []
    except UnicodeDecodeError:
        return None
    for line in lines:
        digest, _, name = line.partition("  ")
        if name == wanted:
            return digest
    return None


def _sums_manifest_line(path: Location, wanted: str = MANIFEST) -> str | None:
    try:
        return _sums_line((path / SUMS_FILE).read_bytes(), wanted)
    except OSError:
        return None


def _derived_statement(
    root: Location, manifest_digest: str, entries: Sequence[Mapping[str, Any]], sums: bytes | None
) -> tuple[list[dict[str, str]], list[FileProblem]]:
    """The provenance statement where the manifest does not list it: ``(its SHA256SUMS entry, its problems)``.

    Note: a statement saved since it names the manifest (``provenance/statement.py``) is a derived record:
    ``SHA256SUMS`` records its SHA-256, and its subject must be this manifest's hash. A statement of the earlier
    form is listed in the manifest and checked as a listed file; a checkpoint without one has nothing here.
    """
    if any(e["path"] == STATEMENT_FILE for e in entries):
        return [], []
    recorded = _sums_line(sums, STATEMENT_FILE)
    file = root / STATEMENT_FILE
    try:
        raw = file.read_bytes()
    except (FileNotFoundError, IsADirectoryError):
        if recorded is None:
            return [], []  # saved before statements, or adopted: it never had one
        missing = FileProblem(STATEMENT_FILE, "missing", f"{SUMS_FILE} records it ({recorded}) but it is not present")
        return [{"path": STATEMENT_FILE, "sha256": recorded}], [missing]
    except OSError as e:
        raise read_error(file, e) from e
    actual = hashlib.sha256(raw).hexdigest()
    entry = [{"path": STATEMENT_FILE, "sha256": recorded or actual}]
    if recorded != actual:
        return entry, [FileProblem(STATEMENT_FILE, "altered", f"sha256 {actual}, {SUMS_FILE} records {recorded}")]
    named = named_manifest(raw)
    if named != manifest_digest:
        what = f"names manifest {named}" if named else "does not name the manifest as its subject"
        return entry, [FileProblem(STATEMENT_FILE, "altered", f"{what}; this checkpoint's is {manifest_digest}")]
    return entry, []


def _unexpected(
    path: Location, expected: set[str], prefix: str = "", folders: set[str] | None = None
) -> list[FileProblem]:
    """Files and folders at ``path`` the manifest does not list; a folder it lists files in (an adopted
    Trainer checkpoint's DCP subfolders, a bucket save's ``shards/GGGG/``) is looked into."""
    if folders is None:  # every folder a listed file is in, once (64 folders of 131k files at 16,384 ranks)
        folders = {e.rpartition("/")[0] for e in expected if "/" in e}
        folders |= {f[:i] for f in list(folders) for i in range(len(f)) if f[i] == "/"}
    out = []
    children: Iterator[Location] = path.iterdir()
    for child in sorted(children):
        name = prefix + child.name
        if name in expected:
            continue
        if name in folders and child.is_dir():
            out.extend(_unexpected(child, expected, f"{name}/", folders))
            continue
        what = "directory" if child.is_dir() else f"{child.stat().st_size} bytes"
        out.append(FileProblem(name, "unexpected", f"not listed in the manifest ({what})"))
    return out


def _small_file(root: Location, name: str) -> bytes | None:
    """The bytes of a derived record (None when it is absent); a file system's failure raises ``read_error``."""
    file = root / name
    try:
        return file.read_bytes()
    except (FileNotFoundError, IsADirectoryError):
        return None
    except OSError as e:
        raise read_error(file, e) from e


def derived_and_unexpected(
    root: Location,
    manifest_digest: str,
    entries: Sequence[Mapping[str, Any]],
    known: Sequence[FileProblem] = (),
    *,
    read: Mapping[str, bytes] | None = None,
) -> list[FileProblem]:
    """``manifest.sha256``, ``SHA256SUMS`` and the provenance statement as the manifest implies them, and files the
    manifest does not list.

    Files already named in ``known`` are not reported twice. ``read``: the bytes of derived records the caller
    has already read (``manifest.sha256``, read to anchor the manifest), checked here without a second read.
    """
    # Note: each small record is read once (on an object store, each read is a GET): SHA256SUMS gives the
    # statement's recorded digest and is then compared whole, from the same bytes.
    named = {p.path for p in known}
    given: dict[str, bytes | None] = dict(read or {})
    if SUMS_FILE not in given:
        given[SUMS_FILE] = _small_file(root, SUMS_FILE)
    statement, problems = _derived_statement(root, manifest_digest, entries, given[SUMS_FILE])
    for name, wanted in (
        (MANIFEST_HASH_FILE, render_manifest_hash_file(manifest_digest)),
        (SUMS_FILE, render_sums(manifest_digest, [*entries, *statement])),
    ):
        if name in named:
            continue
        data = given[name] if name in given else _small_file(root, name)
        if data is None:
            problems.append(FileProblem(name, "missing", "derived from the manifest; should be present"))
        elif data != wanted:
            problems.append(FileProblem(name, "altered", "does not match the hashes the manifest records"))
    expected = {str(e["path"]) for e in [*entries, *statement]} | {MANIFEST, MANIFEST_HASH_FILE, SUMS_FILE}
    problems.extend(_unexpected(root, expected))
    return problems


def verify_checkpoint(
    path: Location | str | os.PathLike[str],
    *,
    level: VerifyLevel | str = "full",
    expected_manifest_hash: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> VerifyReport:
    """Check every file of the checkpoint at ``path`` against its manifest.

    The report names each missing, altered or unexpected file. ``expected_manifest_hash`` (e.g.
    from the lineage ledger or a release note) additionally pins the manifest itself: without
    it, a consistent rewrite of manifest, hashes and data cannot be told from the original.

    ``path`` may be an object-store URL (``s3://bucket/prefix/step-100``); ``storage_options`` then go
    to its fsspec file system (default: the standard AWS environment).

    Raises:
        ConfigurationError: ``level`` is not ``full`` or ``sizes``, or ``expected_manifest_hash``
            is not a SHA-256 in hex.
        StorageAccessError: a URL whose bucket does not exist, credentials are refused, or endpoint is down.
    """
    level = VerifyLevel.parse(level)
    if level is VerifyLevel.NONE:
        raise ConfigurationError("verify_checkpoint checks files: use level 'full' (default) or 'sizes'")
    expected_manifest_hash = check_expected_hash(expected_manifest_hash)
    root = locate(path, storage_options=storage_options)
    store = store_for(root)
    store.check_access(root)
    root = store.snapshot(root)  # in a store, one LIST answers every "present? what size?" below
    base = {"path": str(root), "level": level.value}
    if not root.is_dir():
        return VerifyReport(**base, manifest_hash=None, step=None, files_checked=0, bytes_checked=0,
                            error=f"{root} is not a checkpoint: no such directory")  # fmt: skip
    manifest_file = root / MANIFEST
    if not manifest_file.is_file():
        if (root / DCP_METADATA).is_file():
            error = (
                f"{root} is a plain torch.distributed.checkpoint directory without a shardline manifest: it has "
                "no lineage and no recorded hashes, so it cannot be verified; `shardline adopt` brings it under "
                "lineage (its files hashed from then on)"
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
    problems.extend(derived_and_unexpected(root, actual, entries, problems))
    # manifest.json and its two hash files, and a statement that names the manifest (checked as derived from it)
    derived = 3 + (all(e["path"] != STATEMENT_FILE for e in entries) and (root / STATEMENT_FILE).is_file())
    return VerifyReport(
        **base,
        manifest_hash=actual,
        step=manifest.get("step"),
        files_checked=len(entries) + derived,
        bytes_checked=read + len(raw),
        problems=tuple(problems),
    )
