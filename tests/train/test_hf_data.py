"""data.name=hf: a local Hugging Face dataset (save_to_disk folders, parquet/arrow/jsonl/csv files), built here."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

from shardline.errors import ConfigurationError
from shardline.train.data import check_data_config, load_corpus
from tests.train.test_your_data import DOCS, build_tokenizer, data_cfg

datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """load_dataset converts files into its cache: keep it inside the test (and its progress bars quiet)."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    datasets.disable_progress_bars()


def hf_cfg(**kw):
    return data_cfg(**{"name": "hf", "text_column": "body", "split": None, **kw})


def test_every_local_form_reads_the_same_documents(tmp_path: Path) -> None:
    """save_to_disk (Dataset and DatasetDict), parquet, a folder of jsonl, csv and arrow: one corpus, the tokenizer's ids."""
    tok_path = build_tokenizer(tmp_path / "tokenizer.json")
    train = datasets.Dataset.from_dict({"id": list(range(50)), "body": DOCS[:50]})
    val = datasets.Dataset.from_dict({"id": list(range(50, 60)), "body": DOCS[50:]})
    train.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": train, "validation": val}).save_to_disk(str(tmp_path / "dict"))
    train.to_parquet(str(tmp_path / "parquet" / "part-0.parquet"))
    (tmp_path / "jsonl" / "nested").mkdir(parents=True)
    train.select(range(25)).to_json(str(tmp_path / "jsonl" / "a.jsonl"))
    train.select(range(25, 50)).to_json(str(tmp_path / "jsonl" / "nested" / "b.jsonl"))
    train.to_csv(str(tmp_path / "docs.csv"), index=False)
    (tmp_path / "arrow").mkdir()
    for shard in (tmp_path / "saved").glob("*.arrow"):  # save_to_disk's shards are arrow stream files
        shutil.copy(shard, tmp_path / "arrow" / shard.name)
    val.to_parquet(str(tmp_path / "val.parquet"))

    reference = tokenizers.Tokenizer.from_file(str(tok_path))
    eos = reference.token_to_id("</s>")

    def ids(docs: list[str]) -> list[int]:
        return [t for doc in docs for t in [*reference.encode(doc, add_special_tokens=False).ids, eos]]

    forms = ["saved", "dict", "parquet/part-0.parquet", "parquet", "jsonl", "docs.csv", "arrow"]
    corpora = {}
    for form in forms:
        cfg = hf_cfg(path=str(tmp_path / form), val_path=str(tmp_path / "val.parquet"), tokenizer=str(tok_path))
        check_data_config(cfg)
        corpora[form] = load_corpus(cfg)
    for form, corpus in corpora.items():
        assert corpus.train.tolist() == ids(DOCS[:50]), f"{form}: rows in order, the tokenizer's ids, </s> between"
        assert corpus.val.tolist() == ids(DOCS[50:]), form
        assert (corpus.files_train, corpus.files_val, corpus.vocab_size) == (50, 10, reference.get_vocab_size())
        assert corpus.packed, form
    assert len({c.fingerprint for c in corpora.values()}) == 1, "the fingerprint is the data's, not its storage's"

    # A DatasetDict as validation data: its validation split; as data.path with data.split: that split.
    from_dict = load_corpus(hf_cfg(path=str(tmp_path / "saved"), val_path=str(tmp_path / "dict")))
    assert from_dict.val.tolist() == [b for doc in DOCS[50:] for b in doc.encode() + b"\n\n"], "bytes by default"
    picked = load_corpus(
        hf_cfg(path=str(tmp_path / "dict"), split="validation", val_path=str(tmp_path / "val.parquet"))
    )
    assert picked.files_train == 10
    # Without val_path: about one row in val_every held out, by the row's index; every row used exactly once.
    held = load_corpus(hf_cfg(path=str(tmp_path / "saved"), val_every=5))
    assert held.files_train + held.files_val == 50
    assert 0 < held.files_val < 25
    assert torch.equal(load_corpus(hf_cfg(path=str(tmp_path / "parquet"), val_every=5)).train, held.train)
    # Changing one row's text changes the fingerprint.
    changed = train.map(lambda row, i: {"body": row["body"] + ("!" if i == 7 else "")}, with_indices=True)
    changed.save_to_disk(str(tmp_path / "changed"))
    assert load_corpus(hf_cfg(path=str(tmp_path / "changed"), val_every=5)).fingerprint != held.fingerprint


def test_hf_mistakes_are_one_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ds = datasets.Dataset.from_dict({"id": [1, 2, 3], "body": ["a b", "c d", None]})
    ds.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"a": ds, "b": ds}).save_to_disk(str(tmp_path / "two"))
    cases = [
        (hf_cfg(path=str(tmp_path / "saved"), text_column="text"), r"data.text_column='text' is not a column of "
         r"data.path=.*saved; its columns: id, body. Set data.text_column"),
        (hf_cfg(path=str(tmp_path / "saved"), text_column="id"), r"data.text_column='id' of .* holds .*int64.*not text"),
        (hf_cfg(path=str(tmp_path / "saved")), r"data.path=.*saved: row 2 has no text \(column 'body' is null\)"),
        (hf_cfg(path=str(tmp_path / "two")), r"has several splits \(a, b\); choose one with data.split=NAME"),
        (hf_cfg(path=str(tmp_path / "two"), split="train"), r"data.split='train' is not a split of .*; its splits: a, b"),
        (hf_cfg(path=str(tmp_path / "saved"), split="train"), r"is a single dataset without splits, but data.split"),
    ]  # fmt: skip
    for cfg, message in cases:
        with pytest.raises(ConfigurationError, match=message):
            load_corpus(cfg)
    (tmp_path / "mixed").mkdir()
    ds.to_parquet(str(tmp_path / "mixed" / "a.parquet"))
    ds.to_csv(str(tmp_path / "mixed" / "b.csv"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("x")
    for path, message in [
        (tmp_path / "mixed", r"mixes formats \(csv, parquet\); one dataset is one format"),
        (tmp_path / "empty", r"is a folder, but neither a save_to_disk folder .* nor one holding .parquet"),
        (tmp_path / "notes.txt", r"notes.txt is not a format data.name=hf reads"),
        (tmp_path / "missing", r"data.path=.*missing matches no file"),
    ]:
        with pytest.raises(ConfigurationError, match=message):
            check_data_config(hf_cfg(path=str(path)))
    with pytest.raises(ConfigurationError, match=r"data.path is not set"):
        check_data_config(hf_cfg(path=None))
    with pytest.raises(ConfigurationError, match=r"data.split='train' applies to data.name=hf .* not data.name=jsonl"):
        check_data_config(hf_cfg(name="jsonl", path=str(tmp_path / "mixed" / "b.csv"), split="train"))
    (tmp_path / "broken.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(ConfigurationError, match=r"broken.parquet: the datasets library cannot read it"):
        load_corpus(hf_cfg(path=str(tmp_path / "broken.parquet")))
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if the extra were not installed
    with pytest.raises(ConfigurationError, match=r'pip install "shardline\[hf\]"'):
        check_data_config(hf_cfg(path=str(tmp_path / "saved")))
