"""The built-in corpus: Python's own standard library sources, as bytes.

Every machine with Python has the corpus, so the default experiment needs no download. It is
built deterministically: ``.py`` files under the standard library directory (no
``site-packages``, no caches), sorted by relative path, each assigned to validation when the
SHA-256 of its path falls in a fixed bucket, read until the train split holds ``max_bytes``
and the validation split about ``max_bytes / val_every``. Its fingerprint is the
SHA-256 of every file's path and bytes in order, so two runs can prove they saw the same data
(different Python versions have different standard libraries, hence different fingerprints).
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from pathlib import Path

import torch

from shardline.errors import ConfigurationError
from shardline.train.data.corpus import Corpus

__all__ = ["build_stdlib_corpus"]

# Installed packages, caches, test suites and demos are not "the standard library".
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "idlelib", "turtledemo", "test", "tests"}
# Generated at build time and different on every machine.
_SKIP_PREFIXES = ("_sysconfigdata",)


def _stdlib_files(root: Path) -> list[Path]:
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        found.extend(Path(dirpath) / f for f in filenames if f.endswith(".py") and not f.startswith(_SKIP_PREFIXES))
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _is_val(relpath: str, val_every: int) -> bool:
    return int.from_bytes(hashlib.sha256(relpath.encode()).digest()[:4], "big") % val_every == 0


def build_stdlib_corpus(*, max_bytes: int, val_every: int = 20, root: str | os.PathLike[str] | None = None) -> Corpus:
    """Read the standard library's Python sources into a byte corpus (see the module docstring).

    Args:
        max_bytes: Stop adding training files once the train split holds this many bytes.
        val_every: About one file in ``val_every`` goes to validation.
        root: Directory to read (default: this interpreter's standard library).
    """
    if max_bytes < 1024:
        raise ConfigurationError(f"data.max_bytes must be at least 1024, got {max_bytes}")
    if val_every < 2:
        raise ConfigurationError(f"data.val_every must be at least 2, got {val_every}")
    base = Path(root) if root is not None else Path(sysconfig.get_paths()["stdlib"])
    digest = hashlib.sha256()
    train: list[bytes] = []
    val: list[bytes] = []
    n_train = n_val = size = val_size = 0
    val_target = max(1, max_bytes // val_every)
    for path in _stdlib_files(base):
        rel = path.relative_to(base).as_posix()
        is_val = _is_val(rel, val_every)
        if (is_val and val_size >= val_target) or (not is_val and size >= max_bytes):
            continue  # this split is full; keep scanning for the other
        try:
            data = path.read_bytes()
        except OSError:
            continue
        digest.update(b"val\0" if is_val else b"train\0")
        digest.update(rel.encode() + b"\0" + str(len(data)).encode() + b"\0" + data)
        if is_val:
            val.append(data + b"\n\n")
            n_val += 1
            val_size += len(data) + 2
        else:
            train.append(data + b"\n\n")
            n_train += 1
            size += len(data) + 2
        if size >= max_bytes and val_size >= val_target:
            break
    if not train or not val:
        raise ConfigurationError(
            f"no usable Python sources under {base} (found {n_train} train and {n_val} validation files); "
            "point data.root at a directory of .py files"
        )
    return Corpus(
        train=_as_tokens(b"".join(train)),
        val=_as_tokens(b"".join(val)),
        fingerprint=digest.hexdigest(),
        source=f"Python {sys.version_info.major}.{sys.version_info.minor} standard library"
        if root is None
        else str(base),
        files_train=n_train,
        files_val=n_val,
    )


def _as_tokens(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()
