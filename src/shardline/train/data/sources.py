"""``data.name`` -> a corpus: the built-in one, your text, JSONL or token files (``files.py``), or a local
Hugging Face dataset (``hf_dataset.py``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, get_args

from torch import nn

from shardline.errors import ConfigurationError
from shardline.train.data.corpus import Corpus
from shardline.train.data.files import TOKEN_SUFFIXES, build_text_corpus, build_token_corpus, expand_paths
from shardline.train.data.hf_dataset import build_hf_corpus, check_hf_path
from shardline.train.data.stdlib import build_stdlib_corpus
from shardline.train.data.tokenizer import load_encoder

__all__ = ["SOURCES", "DataSource", "check_data_config", "check_source", "check_vocab", "load_corpus"]

DataSource = Literal["stdlib", "text", "jsonl", "tokens", "hf"]
"""``data.name``: the built-in corpus, text files, JSON lines, a pre-tokenized array, or a local Hugging Face
dataset."""
SOURCES: tuple[str, ...] = get_args(DataSource)


def check_source(name: str) -> DataSource:
    """``name`` if it is one of :data:`SOURCES`.

    Raises:
        ConfigurationError: naming the value and the choices.
    """
    if name not in SOURCES:
        raise ConfigurationError(f"unknown data source data.name={name!r}; available: {', '.join(SOURCES)}")
    return name  # type: ignore[return-value]


def check_data_config(data: Any) -> None:
    """Cheap checks of the data config before any worker starts: the source, and that its files exist.

    Raises:
        ConfigurationError: an unknown ``data.name``, a glob matching nothing, a missing token file
            or tokenizer.
    """
    check_source(data.name)
    if data.name != "hf" and getattr(data, "split", None) is not None:
        raise ConfigurationError(
            f"data.split={data.split!r} applies to data.name=hf (a Hugging Face dataset), not data.name={data.name}; "
            "remove data.split"
        )
    if data.name in ("text", "jsonl"):
        expand_paths(data.path, "data.path")
        if data.val_path is not None:
            expand_paths(data.val_path, "data.val_path")
    if data.name == "hf":
        check_hf_path(data.path, "data.path")
        if data.val_path is not None:
            check_hf_path(data.val_path, "data.val_path")
    if data.name == "tokens":
        for key in ("path", "val_path"):
            value = getattr(data, key)
            if value is None and key == "val_path":
                continue
            if value is None or not Path(os.path.expanduser(str(value))).is_file():
                raise ConfigurationError(
                    f"data.{key}={value}: no such token file; pass a {' or '.join(TOKEN_SUFFIXES)} file"
                )
    if data.tokenizer is not None and not Path(os.path.expanduser(str(data.tokenizer))).exists():
        raise ConfigurationError(
            f"data.tokenizer={data.tokenizer}: no such file or folder. Pass a tokenizer.json file or a folder "
            "saved with save_pretrained (nothing is downloaded)."
        )


def load_corpus(data: Any) -> Corpus:
    """The corpus the data config describes (any object with the ``DataConfig`` fields as attributes)."""
    check_source(data.name)
    if data.name == "stdlib":
        if data.tokenizer is not None:
            raise ConfigurationError(
                "data.tokenizer applies to your own text (data.name=text, jsonl or hf); the built-in stdlib corpus is "
                "bytes"
            )
        return build_stdlib_corpus(max_bytes=data.max_bytes, val_every=data.val_every, root=data.root)
    if data.name == "tokens":
        vocab = load_encoder(data.tokenizer).vocab_size if data.tokenizer is not None else None
        return build_token_corpus(
            path=data.path,
            val_path=data.val_path,
            val_every=data.val_every,
            token_dtype=data.token_dtype,
            vocab_size=vocab,
        )
    if data.name == "hf":
        return build_hf_corpus(
            path=data.path,
            val_path=data.val_path,
            split=data.split,
            text_column=data.text_column,
            val_every=data.val_every,
            encoder=load_encoder(data.tokenizer, eos_token=data.eos_token),
        )
    return build_text_corpus(
        kind=data.name,
        path=data.path,
        val_path=data.val_path,
        val_every=data.val_every,
        text_field=data.text_field,
        encoder=load_encoder(data.tokenizer, eos_token=data.eos_token),
    )


def check_vocab(corpus: Corpus, model: nn.Module) -> None:
    """Refuse data whose token ids do not fit the model's first embedding (checked before any compute).

    Works on a model built on the meta device. Models without an ``nn.Embedding`` are not checked.
    """
    embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if embedding is not None and corpus.vocab_size > embedding.num_embeddings:
        raise ConfigurationError(
            f"the data has token ids up to {corpus.vocab_size - 1} ({corpus.vocab_size}-id vocabulary), but the "
            f"model's embedding has {embedding.num_embeddings} rows. Set the model's vocabulary size to at least "
            f"{corpus.vocab_size} (e.g. model.vocab_size={corpus.vocab_size})."
        )
