"""A training corpus: the token stream of each split, where it came from, and reading windows of it.

A split is a 1-D stream of token ids: a ``torch.Tensor`` held in memory (text tokenized at
start-up, or bytes) or a read-only ``numpy`` memory map of a token file, so a corpus larger
than memory costs only the windows actually read.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["Corpus", "TokenStream", "stream_length", "take_windows"]

TokenStream = torch.Tensor | np.ndarray


def stream_length(data: TokenStream) -> int:
    """Number of tokens in a split."""
    return int(data.numel()) if isinstance(data, torch.Tensor) else int(data.shape[0])


def take_windows(data: TokenStream, starts: torch.Tensor, length: int) -> torch.Tensor:
    """``(len(starts), length)`` int64 windows ``data[s : s + length]``."""
    if isinstance(data, torch.Tensor):
        return data[starts[:, None] + torch.arange(length)].long()
    rows = [np.asarray(data[int(s) : int(s) + length], dtype=np.int64) for s in starts.tolist()]
    if not rows:
        return torch.empty((0, length), dtype=torch.long)
    return torch.from_numpy(np.stack(rows))


@dataclass(frozen=True)
class Corpus:
    """Token ids of the train and validation splits, and where they came from.

    Attributes:
        train, val: The two splits (see the module docstring).
        fingerprint: SHA-256 over the data (and the tokenizer) in a fixed order; recorded in
            ``summary.json`` and every checkpoint manifest.
        source: Where the data came from, in words.
        files_train, files_val: Files (built-in corpus) or documents (files, JSON lines) in each
            split; 0 for token files.
        vocab_size: Token ids are below this (256 for bytes; the tokenizer's size otherwise).
        packed: Batches are consecutive fixed windows (see :class:`PackedBatches`) rather than
            random offsets (the built-in corpus).
        unit: What one token is, for messages ("bytes" or "tokens").
    """

    train: TokenStream
    val: TokenStream
    fingerprint: str
    source: str
    files_train: int
    files_val: int
    vocab_size: int = 256
    packed: bool = False
    unit: str = "bytes"

    def describe(self) -> str:
        def docs(n: int) -> str:
            noun = "document" if self.packed else "file"
            return f" ({n} {noun}" + ("" if n == 1 else "s") + ")"

        if self.unit == "bytes":
            train = f"{stream_length(self.train) / 1e6:.1f} MB train"
            val = f"{stream_length(self.val) / 1e6:.2f} MB validation"
        else:
            train = f"{stream_length(self.train) / 1e6:.2f} M tokens train"
            val = f"{stream_length(self.val) / 1e6:.3f} M tokens validation"
        train += docs(self.files_train) if self.files_train else ""
        val += docs(self.files_val) if self.files_val else ""
        return f"{self.source}: {train}, {val}, sha256 {self.fingerprint[:12]}"
