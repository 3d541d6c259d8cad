"""The tokenizer a run trained with, written beside its exported weights so ``AutoTokenizer.from_pretrained`` works.

A checkpoint saved by ``shardline train`` records its resolved training config, and with it
``data.tokenizer``: ``null`` for UTF-8 bytes (the default experiments), a ``tokenizer.json``
file, or a Hugging Face tokenizer folder. :func:`tokenizer_files` turns that into the files an
export carries:

* bytes: a real ``tokenizers`` ``tokenizer.json`` whose ids are exactly the UTF-8 bytes
  (:func:`byte_tokenizer_json`), with a ``tokenizer_config.json`` naming
  ``PreTrainedTokenizerFast``;
* a ``tokenizer.json`` file: that file, with the same ``tokenizer_config.json``;
* a folder: its tokenizer files (:data:`TOKENIZER_FILES`), as ``save_pretrained`` wrote them.

Note: a tokenizer path is read when the export runs. If it is gone by then, the export is
written without it and says so (a warning, and the result's note); the weights never wait on it.

Note: the byte tokenizer. Token ``b`` is the byte ``b``: the model is a BPE without merges over the
256 characters of the byte-level alphabet (the GPT-2 mapping of bytes to printable characters,
:func:`_bytes_to_chars`), after the byte-level pre-tokenizer without a prefix space or a split;
the byte-level decoder turns ids back into text. So encoding any text gives ``list(text.encode())``,
as training did (``shardline.train.data.tokenizer.ByteEncoder``); the tests check both directions.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["TOKENIZER_FILES", "ExportedTokenizer", "byte_tokenizer_json", "tokenizer_files"]

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "chat_template.jinja",
)
"""The files of a Hugging Face tokenizer folder that an export copies (never ``config.json``: the model's)."""


@dataclass(frozen=True)
class ExportedTokenizer:
    """The tokenizer files for an export (``{name: bytes}``), and a note when the run's tokenizer was not found."""

    files: dict[str, bytes] = field(default_factory=dict)
    note: str | None = None


def _bytes_to_chars() -> dict[int, str]:
    """The byte-level alphabet: each byte as the printable character the byte-level pre-tokenizer maps it to."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def _fast_config(seq_len: int | None) -> bytes:
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    if seq_len:
        config["model_max_length"] = int(seq_len)
    return (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()


def byte_tokenizer_json() -> bytes:
    """A ``tokenizers`` ``tokenizer.json`` whose token ids are the UTF-8 bytes of the text (vocabulary 256)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: b for b, char in _bytes_to_chars().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    text: str = tokenizer.to_str(pretty=True)
    return (text + "\n").encode()


def tokenizer_files(config: Mapping[str, Any] | None) -> ExportedTokenizer:
    """The tokenizer files of the run whose resolved training config is ``config`` (none without a ``data`` section).

    Nothing is written for a checkpoint whose config has no ``data`` section (one not saved by
    ``shardline train``), nor when the ``tokenizers`` package is missing for the byte tokenizer (the note says so).
    """
    data = (config or {}).get("data")
    if not isinstance(data, Mapping):
        return ExportedTokenizer()
    seq_len = data.get("seq_len") if isinstance(data.get("seq_len"), int) else None
    source = data.get("tokenizer")
    if source is None:
        try:
            return ExportedTokenizer(
                {"tokenizer.json": byte_tokenizer_json(), "tokenizer_config.json": _fast_config(seq_len)}
            )
        except ImportError:
            return ExportedTokenizer(note="no tokenizer written: the byte tokenizer needs the tokenizers package")
    path = Path(str(source)).expanduser()
    if path.is_file():
        return ExportedTokenizer({"tokenizer.json": path.read_bytes(), "tokenizer_config.json": _fast_config(seq_len)})
    if path.is_dir():
        found = {name: (path / name).read_bytes() for name in TOKENIZER_FILES if (path / name).is_file()}
        if found:
            return ExportedTokenizer(found)
        return ExportedTokenizer(
            note=f"no tokenizer written: the run's tokenizer folder {path} holds no tokenizer files"
        )
    return ExportedTokenizer(
        note=f"no tokenizer written: the run's tokenizer ({path}, data.tokenizer) is not there any more; copy its "
        "files into the export by hand"
    )
