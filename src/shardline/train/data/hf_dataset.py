"""A local Hugging Face ``datasets`` dataset as a corpus (``data.name=hf``).

``data.path`` is one of:

* a folder written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk`` (it holds
  ``state.json`` or ``dataset_dict.json``), opened with ``datasets.load_from_disk``;
* a ``.parquet``, ``.arrow``, ``.jsonl``/``.json`` or ``.csv`` file, a glob of them, a list of
  globs, or a folder holding them (searched recursively), read with ``datasets.load_dataset``
  and its packaged builder for that format (``parquet``, ``arrow``, ``json``, ``csv``) on the
  local files -- one format per dataset.

Nothing is downloaded: both readers only read the given files (``load_dataset`` converts files
other than ``.arrow`` into its local cache, ``HF_DATASETS_CACHE``, once).

Each row's ``data.text_column`` is one document. The split read is ``data.split`` if given,
else ``train`` when the dataset has one, else its only split (for ``data.val_path``:
``validation``, else ``test``, else the same rule). The documents then go the way of
text files (:mod:`.files`): tokenized with ``data.tokenizer`` (bytes by default), joined with its
separator, packed into fixed windows; validation is ``data.val_path`` (read the same way) when
given, else about one row in ``data.val_every``, chosen by the SHA-256 of the row's index. The
fingerprint covers the tokenizer and every row's split, index and text, in order, so it changes
with the data, not with where or how the data is stored. The data position of a run is its step
(:mod:`.batches`), so resuming continues at the next unseen window.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from shardline.errors import ConfigurationError
from shardline.train.data.corpus import Corpus
from shardline.train.data.files import expand_paths, text_stream
from shardline.train.data.tokenizer import TextEncoder

__all__ = ["HF_BUILDERS", "build_hf_corpus", "check_hf_path"]

HF_BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".jsonl": "json", ".json": "json", ".csv": "csv"}
"""File suffix -> the ``datasets`` builder that reads it."""
_SAVED_MARKERS = ("dataset_dict.json", "state.json")
_ROWS = 1024


def _datasets() -> Any:
    try:
        import datasets
    except ImportError:
        raise ConfigurationError(
            "data.name=hf reads with the Hugging Face datasets library, which is not installed: "
            'pip install "shardline[hf]"'
        ) from None
    datasets.disable_progress_bars()
    datasets.utils.logging.set_verbosity_error()
    return datasets


def _is_saved(path: Path) -> bool:
    return path.is_dir() and any((path / marker).is_file() for marker in _SAVED_MARKERS)


def _data_files(path: Any, key: str) -> tuple[str, list[str]]:
    """The builder and the files of ``path`` (a folder of data files, a file, a glob or a list of globs)."""
    single = Path(os.path.expanduser(str(path))) if isinstance(path, (str, os.PathLike)) else None
    if single is not None and single.is_dir():
        files = sorted(p.absolute() for p in single.rglob("*") if p.is_file() and p.suffix in HF_BUILDERS)
        if not files:
            raise ConfigurationError(
                f"{key}={path} is a folder, but neither a save_to_disk folder (no {' or '.join(_SAVED_MARKERS)}) nor "
                f"one holding {', '.join(HF_BUILDERS)} files"
            )
    else:
        files = expand_paths(path, key)
    kinds = {HF_BUILDERS.get(p.suffix) for p in files}
    if None in kinds:
        odd = next(p for p in files if p.suffix not in HF_BUILDERS)
        raise ConfigurationError(
            f"{key}={path}: {odd.name} is not a format data.name=hf reads ({', '.join(HF_BUILDERS)}, or a "
            "save_to_disk folder)"
        )
    if len(kinds) > 1:
        raise ConfigurationError(
            f"{key}={path} mixes formats ({', '.join(sorted(k for k in kinds if k))}); one dataset is one format. "
            "Point it at files of one kind."
        )
    kind = kinds.pop()
    assert kind is not None  # refused above
    return kind, [str(p) for p in files]


def check_hf_path(path: Any, key: str) -> None:
    """Cheap checks before any worker starts: the library is installed and ``path`` names readable data.

    Raises:
        ConfigurationError: ``datasets`` missing (naming the extra), no path, or nothing there in a format it reads.
    """
    _datasets()
    if path is None:
        raise ConfigurationError(
            f"{key} is not set; give a save_to_disk folder or your parquet/arrow/jsonl/csv files, e.g. "
            f"{key}=data/my_dataset"
        )
    single = Path(os.path.expanduser(str(path))) if isinstance(path, (str, os.PathLike)) else None
    if single is None or not _is_saved(single):
        _data_files(path, key)


def _select_split(loaded: Any, split: str | None, where: str, *, preferred: tuple[str, ...]) -> Any:
    """One split of a ``DatasetDict`` (or the ``Dataset`` itself): ``split``, else the first of ``preferred`` it
    has, else its only one."""
    if not hasattr(loaded, "keys"):
        if split is not None:
            raise ConfigurationError(
                f"{where} is a single dataset without splits, but data.split={split!r}; remove data.split"
            )
        return loaded
    names = list(loaded.keys())
    if split is not None:
        if split not in names:
            raise ConfigurationError(f"data.split={split!r} is not a split of {where}; its splits: {', '.join(names)}")
        return loaded[split]
    for name in preferred:
        if name in names:
            return loaded[name]
    if len(names) == 1:
        return loaded[names[0]]
    raise ConfigurationError(f"{where} has several splits ({', '.join(names)}); choose one with data.split=NAME")


def load_hf_dataset(path: Any, *, split: str | None, key: str, preferred: tuple[str, ...] = ("train",)) -> Any:
    """The ``datasets.Dataset`` at ``path`` (see the module docstring): ``split``, else the first of ``preferred``
    the dataset has, else its only split."""
    datasets = _datasets()
    check_hf_path(path, key)
    single = Path(os.path.expanduser(str(path))) if isinstance(path, (str, os.PathLike)) else None
    where = f"{key}={path}"
    try:
        if single is not None and _is_saved(single):
            loaded = datasets.load_from_disk(str(single))
        else:
            builder, files = _data_files(path, key)
            loaded = datasets.load_dataset(builder, data_files=files)
    except ConfigurationError:
        raise
    except Exception as exc:  # the library's own parse errors (a bad parquet footer, a malformed CSV row...)
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigurationError(
            f"{where}: the datasets library cannot read it ({type(exc).__name__}: {first})"
        ) from None
    return _select_split(loaded, split, where, preferred=preferred)


def _texts(dataset: Any, column: str, where: str) -> Iterator[str]:
    if column not in dataset.column_names:
        raise ConfigurationError(
            f"data.text_column={column!r} is not a column of {where}; its columns: {', '.join(dataset.column_names)}. "
            "Set data.text_column to the one that holds the text."
        )
    feature = dataset.features[column]
    if getattr(feature, "dtype", None) not in ("string", "large_string"):
        raise ConfigurationError(
            f"data.text_column={column!r} of {where} holds {feature}, not text; set data.text_column to a string column"
        )
    index = 0
    for batch in dataset.select_columns([column]).iter(batch_size=_ROWS):
        for text in batch[column]:
            if text is None:
                raise ConfigurationError(f"{where}: row {index} has no text (column {column!r} is null)")
            yield text
            index += 1


def _is_val(index: int, val_every: int) -> bool:
    return int.from_bytes(hashlib.sha256(f"row {index}".encode()).digest()[:4], "big") % val_every == 0


def build_hf_corpus(
    *,
    path: Any,
    val_path: Any,
    split: str | None,
    text_column: str,
    val_every: int,
    encoder: TextEncoder,
) -> Corpus:
    """A corpus from a local Hugging Face dataset (see the module docstring)."""
    if val_every < 2:
        raise ConfigurationError(f"data.val_every must be at least 2, got {val_every}")
    digest = hashlib.sha256(encoder.fingerprint.encode() + b"\0hf\0")
    texts: dict[str, list[str]] = {"train": [], "val": []}
    sources: list[tuple[str, Any, str, str | None, tuple[str, ...]]] = [("train", path, "data.path", split, ("train",))]
    if val_path is not None:
        sources.append(("val", val_path, "data.val_path", None, ("validation", "test", "train")))
    for split_name, source, key, chosen, preferred in sources:
        dataset = load_hf_dataset(source, split=chosen, key=key, preferred=preferred)
        for index, text in enumerate(_texts(dataset, text_column, f"{key}={source}")):
            target = split_name if val_path is not None else ("val" if _is_val(index, val_every) else "train")
            texts[target].append(text)
            data = text.encode("utf-8")
            digest.update(f"{target}\0{split_name}\0{index}\0{len(data)}\0".encode() + data)
    if not texts["train"] or not texts["val"]:
        raise ConfigurationError(
            f"data.path={path} gave {len(texts['train'])} training and {len(texts['val'])} validation rows; both "
            "splits need at least one. Add rows, lower data.val_every, or pass data.val_path."
        )
    described = f"hf {path}" + (f" [{split}]" if split is not None else "") + f" column {text_column!r}"
    return Corpus(
        train=text_stream(encoder.encode_batch(texts["train"]), encoder.separator),
        val=text_stream(encoder.encode_batch(texts["val"]), encoder.separator),
        fingerprint=digest.hexdigest(),
        source=described + (f" (tokenizer {encoder.name})" if encoder.name != "bytes" else ""),
        files_train=len(texts["train"]),
        files_val=len(texts["val"]),
        vocab_size=encoder.vocab_size,
        packed=True,
        unit="bytes" if encoder.name == "bytes" else "tokens",
    )
