"""Text to token ids: bytes (the default), a ``tokenizer.json`` file, or a local Hugging Face tokenizer folder.

Nothing is downloaded: a folder is loaded with ``AutoTokenizer.from_pretrained(folder,
local_files_only=True)``. Every encoder has a fingerprint (the SHA-256 of its files), which the
corpus fingerprint includes, so a run records which tokenizer produced its data.

Note: the document separator. Documents are joined into one stream before packing; the
separator is the tokenizer's end-of-sequence token -- ``data.eos_token`` if set, else the one a
Hugging Face folder declares, else the first of ``<|endoftext|>``, ``</s>``, ``<eos>`` in the
vocabulary -- and ``"\\n\\n"`` for bytes. A tokenizer with none of these joins documents directly.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shardline.errors import ConfigurationError

__all__ = ["ByteEncoder", "HFEncoder", "TextEncoder", "load_encoder"]

_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>")
_BATCH = 256


class TextEncoder(ABC):
    """What the corpus builders need from a tokenizer."""

    name: str
    vocab_size: int
    separator: list[int]
    fingerprint: str

    @abstractmethod
    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text (no special tokens added)."""


class ByteEncoder(TextEncoder):
    """UTF-8 bytes as token ids (vocabulary 256); documents separated by a blank line."""

    def __init__(self) -> None:
        self.name = "bytes"
        self.vocab_size = 256
        self.separator = list(b"\n\n")
        self.fingerprint = hashlib.sha256(b"utf-8 bytes").hexdigest()

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]


class HFEncoder(TextEncoder):
    """A ``tokenizers.Tokenizer`` (from ``tokenizer.json``) or a ``transformers`` tokenizer (from a folder)."""

    def __init__(self, path: Path, *, eos_token: str | None = None) -> None:
        self.name = str(path)
        self._fast: Any = None
        self._auto: Any = None
        if path.is_dir():
            try:
                from transformers import AutoTokenizer
            except ImportError as exc:
                raise ConfigurationError(
                    f"data.tokenizer={path} is a folder, which is loaded with transformers.AutoTokenizer: "
                    "pip install 'shardline[hf]' (or point data.tokenizer at its tokenizer.json)"
                ) from exc
            try:
                self._auto = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
            except (OSError, ValueError) as exc:
                raise ConfigurationError(
                    f"data.tokenizer={path}: transformers cannot load a tokenizer from this folder ({exc}). It needs "
                    "tokenizer.json (and usually tokenizer_config.json), as save_pretrained writes them."
                ) from None
            self.vocab_size = len(self._auto)
            vocab = self._auto.get_vocab()
            declared = self._auto.eos_token_id
            files = sorted(p for p in path.iterdir() if p.is_file())
        else:
            from tokenizers import Tokenizer

            try:
                self._fast = Tokenizer.from_file(str(path))
            except Exception as exc:
                raise ConfigurationError(
                    f"data.tokenizer={path} is not a tokenizer.json the tokenizers library can read ({exc})"
                ) from None
            self.vocab_size = self._fast.get_vocab_size(with_added_tokens=True)
            vocab = self._fast.get_vocab(with_added_tokens=True)
            declared = None
            files = [path]
        self.separator = self._separator(vocab, declared, eos_token)
        digest = hashlib.sha256()
        for f in files:
            digest.update(f.name.encode() + b"\0" + f.read_bytes())
        digest.update(repr(self.separator).encode())
        self.fingerprint = digest.hexdigest()

    def _separator(self, vocab: dict[str, int], declared: int | None, eos_token: str | None) -> list[int]:
        if eos_token is not None:
            if eos_token not in vocab:
                close = [t for t in _EOS_CANDIDATES if t in vocab]
                raise ConfigurationError(
                    f"data.eos_token={eos_token!r} is not in the vocabulary of {self.name}"
                    + (f"; it has {', '.join(repr(t) for t in close)}" if close else "")
                )
            return [vocab[eos_token]]
        if declared is not None:
            return [int(declared)]
        for candidate in _EOS_CANDIDATES:
            if candidate in vocab:
                return [vocab[candidate]]
        return []

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        out: list[list[int]] = []
        for i in range(0, len(texts), _BATCH):
            chunk = list(texts[i : i + _BATCH])
            if self._fast is not None:
                out.extend(e.ids for e in self._fast.encode_batch(chunk, add_special_tokens=False))
            else:
                out.extend(self._auto(chunk, add_special_tokens=False)["input_ids"])
        return out


def load_encoder(tokenizer: str | None, *, eos_token: str | None = None) -> TextEncoder:
    """Bytes for ``None``; else the tokenizer at ``tokenizer`` (a ``tokenizer.json`` file or a folder).

    Raises:
        ConfigurationError: the path does not exist or holds no readable tokenizer.
    """
    if tokenizer is None:
        if eos_token is not None:
            raise ConfigurationError("data.eos_token needs data.tokenizer; bytes are separated by a blank line")
        return ByteEncoder()
    path = Path(str(tokenizer)).expanduser()
    if not path.exists():
        raise ConfigurationError(
            f"data.tokenizer={tokenizer}: no such file or folder. Pass a tokenizer.json file or a folder saved "
            "with save_pretrained (nothing is downloaded)."
        )
    return HFEncoder(path, eos_token=eos_token)
