"""Your own data: text files, JSONL files, or a pre-tokenized token array.

* ``text``: every file matching ``data.path`` (a glob, or a list of globs; ``**`` recurses) is
  one document, read as UTF-8.
* ``jsonl``: every line of every matching file is one JSON object; its ``data.text_field`` is a
  document. Blank lines are skipped.
* ``tokens``: ``data.path`` is one ``.npy`` array or one raw ``.bin`` file of
  ``data.token_dtype`` ids (nanoGPT's ``train.bin`` layout), opened as a read-only memory map.

Text is tokenized at start-up (bytes, or ``data.tokenizer``), documents are joined with the
tokenizer's separator, and batches are packed fixed windows. The validation split is the files
matching ``data.val_path`` when given; otherwise about one document in ``data.val_every`` is
held out, chosen by the SHA-256 of its path (and line number), so the split does not depend on
file order or count. A token file without ``data.val_path`` keeps its last ``1/val_every`` for
validation.

The fingerprint covers every document's path, split and content, plus the tokenizer, in a fixed
(sorted) order; for token files, their bytes.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shardline.errors import ConfigurationError
from shardline.train.data.corpus import Corpus
from shardline.train.data.tokenizer import TextEncoder

__all__ = ["build_text_corpus", "build_token_corpus", "expand_paths", "text_stream"]

TOKEN_SUFFIXES = (".bin", ".npy")
_TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32, "int32": np.int32, "int64": np.int64}
_HASH_CHUNK = 1 << 22


def expand_paths(patterns: Any, key: str) -> list[Path]:
    """Files matching ``patterns`` (a glob or a list of globs), sorted, without duplicates.

    Raises:
        ConfigurationError: no pattern given, or a pattern that matches no file.
    """
    if patterns is None:
        raise ConfigurationError(f"{key} is not set; give a glob of your files, e.g. {key}='data/*.txt'")
    items = [patterns] if isinstance(patterns, (str, os.PathLike)) else list(patterns)
    found: set[Path] = set()
    for item in items:
        pattern = os.path.expanduser(str(item))
        matches = [Path(p) for p in glob.glob(pattern, recursive=True) if Path(p).is_file()]
        if not matches:
            raise ConfigurationError(
                f"{key}={item} matches no file (relative paths start at {Path.cwd()}); check the path, or quote the "
                "glob so the shell does not expand it"
            )
        found.update(p.absolute() for p in matches)
    return sorted(found)


def _doc_id(path: Path, line: int | None) -> str:
    return path.as_posix() if line is None else f"{path.as_posix()}:{line}"


def _is_val(doc_id: str, val_every: int) -> bool:
    return int.from_bytes(hashlib.sha256(doc_id.encode()).digest()[:4], "big") % val_every == 0


def _documents(files: Sequence[Path], kind: str, text_field: str) -> Iterator[tuple[Path, int | None, str]]:
    for path in files:
        try:
            if kind == "text":
                yield path, None, path.read_text(encoding="utf-8")
                continue
            with open(path, encoding="utf-8") as f:
                for number, line in enumerate(f, start=1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise ConfigurationError(f"{path}:{number} is not valid JSON ({exc.msg})") from None
                    if not isinstance(record, dict) or text_field not in record:
                        keys = ", ".join(sorted(record)) if isinstance(record, dict) else type(record).__name__
                        raise ConfigurationError(
                            f"{path}:{number} has no field {text_field!r} (it has: {keys}); set data.text_field"
                        )
                    if not isinstance(record[text_field], str):
                        raise ConfigurationError(
                            f"{path}:{number}: field {text_field!r} is a {type(record[text_field]).__name__}, "
                            "not a string"
                        )
                    yield path, number, record[text_field]
        except UnicodeDecodeError as exc:
            raise ConfigurationError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        except OSError as exc:
            raise ConfigurationError(f"cannot read {path}: {exc.strerror or exc}") from None


def text_stream(pieces: list[list[int]], separator: list[int]) -> torch.Tensor:
    """Token ids of documents joined into one int32 stream, each followed by ``separator``."""
    flat: list[int] = []
    for piece in pieces:
        flat.extend(piece)
        flat.extend(separator)
    return torch.tensor(flat, dtype=torch.int32) if flat else torch.empty(0, dtype=torch.int32)


def build_text_corpus(
    *,
    kind: str,
    path: Any,
    val_path: Any,
    val_every: int,
    text_field: str,
    encoder: TextEncoder,
) -> Corpus:
    """A corpus from text (``kind="text"``) or JSONL (``kind="jsonl"``) files (see the module docstring)."""
    if val_every < 2:
        raise ConfigurationError(f"data.val_every must be at least 2, got {val_every}")
    train_files = expand_paths(path, "data.path")
    val_files = expand_paths(val_path, "data.val_path") if val_path is not None else []
    digest = hashlib.sha256(encoder.fingerprint.encode() + b"\0" + kind.encode())
    texts: dict[str, list[str]] = {"train": [], "val": []}
    files: dict[str, set[Path]] = {"train": set(), "val": set()}
    for split, sources in (("train", train_files), ("val", val_files)):
        for file, line, text in _documents(sources, kind, text_field):
            doc = _doc_id(file, line)
            target = split if val_path is not None else ("val" if _is_val(doc, val_every) else "train")
            texts[target].append(text)
            files[target].add(file)
            data = text.encode("utf-8")
            digest.update(f"{target}\0{doc}\0{len(data)}\0".encode() + data)
    if not texts["train"] or not texts["val"]:
        raise ConfigurationError(
            f"data.path={path} gave {len(texts['train'])} training and {len(texts['val'])} validation documents; "
            "both splits need at least one. Add documents, lower data.val_every, or pass data.val_path."
        )
    return Corpus(
        train=text_stream(encoder.encode_batch(texts["train"]), encoder.separator),
        val=text_stream(encoder.encode_batch(texts["val"]), encoder.separator),
        fingerprint=digest.hexdigest(),
        source=f"{kind} {path}" + (f" (tokenizer {encoder.name})" if encoder.name != "bytes" else ""),
        files_train=len(texts["train"]),
        files_val=len(texts["val"]),
        vocab_size=encoder.vocab_size,
        packed=True,
        unit="bytes" if encoder.name == "bytes" else "tokens",
    )


def open_tokens(path: Path, token_dtype: str) -> np.ndarray:
    """A read-only memory map of a 1-D ``.npy`` integer array or a raw ``.bin`` file of ``token_dtype`` ids."""
    if path.suffix not in TOKEN_SUFFIXES:
        raise ConfigurationError(f"data.path={path}: a token file must end in .bin or .npy")
    if not path.is_file():
        raise ConfigurationError(f"data.path={path}: no such file")
    if path.suffix == ".npy":
        try:
            array: np.ndarray = np.load(path, mmap_mode="r", allow_pickle=False)
        except ValueError as exc:
            raise ConfigurationError(f"{path} is not a plain .npy array ({exc})") from None
    else:
        if token_dtype not in _TOKEN_DTYPES:
            raise ConfigurationError(
                f"data.token_dtype={token_dtype!r}; use one of {', '.join(_TOKEN_DTYPES)} (nanoGPT writes uint16)"
            )
        dtype = np.dtype(_TOKEN_DTYPES[token_dtype])
        size = path.stat().st_size
        if size % dtype.itemsize:
            raise ConfigurationError(
                f"{path} has {size} bytes, not a whole number of {token_dtype} tokens; check data.token_dtype"
            )
        array = np.memmap(path, dtype=dtype, mode="r")
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise ConfigurationError(
            f"{path} holds a {array.ndim}-D {array.dtype} array; token files hold one 1-D array of integer ids"
        )
    return array


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def build_token_corpus(*, path: Any, val_path: Any, val_every: int, token_dtype: str, vocab_size: int | None) -> Corpus:
    """A corpus from pre-tokenized ids in ``.bin``/``.npy`` files (memory-mapped; see the module docstring).

    Args:
        vocab_size: Ids must be below this; ``None``: the largest id plus one (one pass over the data).
    """
    if path is None:
        raise ConfigurationError("data.path is not set; give the token file, e.g. data.path=data/train.bin")
    train_path = Path(os.path.expanduser(str(path)))
    array = open_tokens(train_path, token_dtype)
    digest = hashlib.sha256(f"tokens\0{train_path.name}\0{_file_sha256(train_path)}".encode())
    if val_path is not None:
        val_file = Path(os.path.expanduser(str(val_path)))
        train, val = array, open_tokens(val_file, token_dtype)
        digest.update(f"\0{val_file.name}\0{_file_sha256(val_file)}".encode())
    else:
        if val_every < 2:
            raise ConfigurationError(f"data.val_every must be at least 2, got {val_every}")
        cut = array.shape[0] - array.shape[0] // val_every
        train, val = array[:cut], array[cut:]
        digest.update(f"\0holdout 1/{val_every}".encode())
    highest = max(int(train.max(initial=0)), int(val.max(initial=0)))
    lowest = min(int(train.min(initial=0)), int(val.min(initial=0)))
    if lowest < 0:
        raise ConfigurationError(f"{train_path} holds negative token ids (smallest {lowest})")
    if vocab_size is not None and highest >= vocab_size:
        raise ConfigurationError(
            f"{train_path} holds token id {highest}, but the vocabulary has {vocab_size} ids; check data.token_dtype "
            "and data.tokenizer"
        )
    return Corpus(
        train=train,
        val=val,
        fingerprint=digest.hexdigest(),
        source=f"tokens {train_path}" + (f" + {val_path}" if val_path is not None else ""),
        files_train=0,
        files_val=0,
        vocab_size=vocab_size if vocab_size is not None else highest + 1,
        packed=True,
        unit="tokens",
    )
