"""Your own data: text globs, JSONL, memory-mapped token arrays, local tokenizers, packed windows."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from shardline.errors import ConfigurationError
from shardline.train.data import (
    PackedBatches,
    build_token_corpus,
    check_data_config,
    check_vocab,
    load_corpus,
    take_windows,
)

tokenizers = pytest.importorskip("tokenizers")

DOCS = [
    f"document {i}: " + " ".join(["the quick brown fox", "jumps over", "the lazy dog"][: 1 + i % 3]) for i in range(60)
]


def data_cfg(**kw) -> SimpleNamespace:
    base = {
        "name": "text",
        "path": None,
        "val_path": None,
        "text_field": "text",
        "tokenizer": None,
        "eos_token": None,
        "token_dtype": "uint16",
        "root": None,
        "max_bytes": 4_000_000,
        "val_every": 5,
        "seq_len": 8,
    }
    return SimpleNamespace(**{**base, **kw})


def build_tokenizer(path: Path) -> Path:
    """A small byte-level BPE trained here on the test documents (nothing downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<unk>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(DOCS, trainer)
    tok.save(str(path))
    return path


def test_text_files_from_a_glob(tmp_path: Path) -> None:
    for i, doc in enumerate(DOCS):
        folder = tmp_path / "corpus" / f"part{i % 3}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{i:02d}.txt").write_text(doc)
    (tmp_path / "corpus" / "notes.md").write_text("not matched")
    cfg = data_cfg(path=str(tmp_path / "corpus" / "**" / "*.txt"))
    check_data_config(cfg)
    corpus = load_corpus(cfg)
    assert corpus.files_train + corpus.files_val == 60
    assert corpus.files_val >= 1
    assert corpus.packed
    assert corpus.vocab_size == 256
    # The stream is the documents' UTF-8 bytes, each followed by a blank line, in sorted path order.
    both = sorted((str(p), p.read_text()) for p in (tmp_path / "corpus").rglob("*.txt"))
    together = b"".join(text.encode() + b"\n\n" for _, text in both)
    train = bytes(corpus.train.to(torch.uint8).tolist())
    val = bytes(corpus.val.to(torch.uint8).tolist())
    assert len(train) + len(val) == len(together)
    # With an explicit validation glob the streams are exactly the documents in sorted path order.
    explicit = load_corpus(
        data_cfg(
            path=str(tmp_path / "corpus" / "part[12]" / "*.txt"), val_path=str(tmp_path / "corpus" / "part0" / "*")
        )
    )
    for split, part in ((explicit.train, "part[12]"), (explicit.val, "part0")):
        files = sorted((tmp_path / "corpus").glob(f"{part}/*.txt"))
        assert bytes(split.to(torch.uint8).tolist()) == b"".join(f.read_bytes() + b"\n\n" for f in files)
    assert load_corpus(cfg).fingerprint == corpus.fingerprint, "deterministic"
    (tmp_path / "corpus" / "part0" / "00.txt").write_text("changed")
    assert load_corpus(cfg).fingerprint != corpus.fingerprint, "the fingerprint covers the content"
    with pytest.raises(ConfigurationError, match=r"data.path=.*\*.rst matches no file"):
        check_data_config(data_cfg(path=str(tmp_path / "*.rst")))


def test_jsonl_with_a_local_tokenizer(tmp_path: Path) -> None:
    tok_path = build_tokenizer(tmp_path / "tokenizer.json")
    lines = [json.dumps({"id": i, "body": doc}) for i, doc in enumerate(DOCS)]
    (tmp_path / "train.jsonl").write_text("\n".join(lines[:50]) + "\n\n")
    (tmp_path / "val.jsonl").write_text("\n".join(lines[50:]))
    cfg = data_cfg(
        name="jsonl",
        path=str(tmp_path / "train.jsonl"),
        val_path=str(tmp_path / "val.jsonl"),
        text_field="body",
        tokenizer=str(tok_path),
    )
    corpus = load_corpus(cfg)
    assert (corpus.files_train, corpus.files_val) == (50, 10)
    reference = tokenizers.Tokenizer.from_file(str(tok_path))
    eos = reference.token_to_id("</s>")
    expected = [t for doc in DOCS[:50] for t in [*reference.encode(doc, add_special_tokens=False).ids, eos]]
    assert corpus.train.tolist() == expected, "the tokenizer's own ids, documents separated by </s>"
    assert corpus.vocab_size == reference.get_vocab_size()
    assert corpus.unit == "tokens"
    # A folder saved with save_pretrained loads through AutoTokenizer and gives the same ids.
    pytest.importorskip("transformers")
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path / "tok"
    PreTrainedTokenizerFast(tokenizer_object=reference, eos_token="</s>").save_pretrained(str(folder))
    assert torch.equal(load_corpus(data_cfg(**{**vars(cfg), "tokenizer": str(folder)})).train, corpus.train)
    # Bad records name the file and line.
    (tmp_path / "bad.jsonl").write_text(lines[0] + "\n{not json}\n")
    with pytest.raises(ConfigurationError, match=r"bad.jsonl:2 is not valid JSON"):
        load_corpus(data_cfg(name="jsonl", path=str(tmp_path / "bad.jsonl"), text_field="body"))
    with pytest.raises(ConfigurationError, match=r"train.jsonl:1 has no field 'text' \(it has: body, id\)"):
        load_corpus(data_cfg(name="jsonl", path=str(tmp_path / "train.jsonl")))
    with pytest.raises(ConfigurationError, match=r"data.eos_token='<end>' is not in the vocabulary"):
        load_corpus(data_cfg(**{**vars(cfg), "eos_token": "<end>"}))


@pytest.mark.parametrize("suffix", [".bin", ".npy"])
def test_token_arrays_are_memory_mapped(tmp_path: Path, suffix: str) -> None:
    ids = (np.arange(5000) * 7919 % 1000).astype(np.uint16)
    path = tmp_path / f"train{suffix}"
    if suffix == ".bin":
        ids.tofile(path)  # nanoGPT's layout: raw uint16
    else:
        np.save(path, ids)
    corpus = load_corpus(data_cfg(name="tokens", path=str(path), val_every=10))
    assert isinstance(corpus.train, np.memmap) or isinstance(corpus.train.base, np.memmap)
    assert len(corpus.train) == 4500, "the last 1/val_every is held out"
    assert len(corpus.val) == 500
    assert corpus.vocab_size == 1000
    starts = torch.tensor([0, 17, 4000])
    assert torch.equal(
        take_windows(corpus.train, starts, 9),
        torch.from_numpy(np.stack([ids[s : s + 9] for s in (0, 17, 4000)]).astype(np.int64)),
    )
    with pytest.raises(ConfigurationError, match="holds token id 999, but the vocabulary has 500 ids"):
        build_token_corpus(path=str(path), val_path=None, val_every=10, token_dtype="uint16", vocab_size=500)
    if suffix == ".bin":
        (tmp_path / "odd.bin").write_bytes(b"\x00" * 6)
        with pytest.raises(ConfigurationError, match="not a whole number of uint32 tokens"):
            load_corpus(data_cfg(name="tokens", path=str(tmp_path / "odd.bin"), token_dtype="uint32"))


def test_packed_windows_cover_each_epoch_once_and_split_across_ranks() -> None:
    data = torch.arange(1 + 8 * 30)  # 30 windows of 8 (+1) tokens
    whole = PackedBatches(data, seq_len=8, global_batch=6, rank=0, world_size=1, seed=3)
    assert whole.windows == 30
    seen = torch.cat([whole.window_ids(step) for step in range(5)])
    assert sorted(seen.tolist()) == list(range(30)), "one epoch = every window exactly once"
    assert not torch.equal(torch.cat([whole.window_ids(s) for s in range(5, 10)]), seen), "a new order per epoch"
    x, y = whole.local(2)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(x[:, 0] % 8, torch.zeros(6, dtype=torch.long)), "windows start on multiples of seq_len"
    for world in (2, 3):
        parts = [PackedBatches(data, seq_len=8, global_batch=6, rank=r, world_size=world, seed=3) for r in range(world)]
        for step in (0, 4, 7):  # step 4 crosses no boundary; step 7 lies in the second epoch
            xs, ys = zip(*(p.local(step) for p in parts), strict=True)
            assert torch.equal(torch.cat(xs), whole.local(step)[0])
            assert torch.equal(torch.cat(ys), whole.local(step)[1])
    fresh = PackedBatches(data, seq_len=8, global_batch=6, rank=0, world_size=1, seed=3)
    assert torch.equal(fresh.local(7)[0], whole.local(7)[0]), "a step's batch depends only on (seed, step)"


def test_vocabulary_must_fit_the_model(tmp_path: Path) -> None:
    from tests.train.user_model import TinyLM

    tok_path = build_tokenizer(tmp_path / "tokenizer.json")
    (tmp_path / "a.txt").write_text("\n".join(DOCS))
    (tmp_path / "b.txt").write_text("\n".join(DOCS[::-1]))
    corpus = load_corpus(
        data_cfg(path=str(tmp_path / "*.txt"), tokenizer=str(tok_path), val_path=str(tmp_path / "b.txt"))
    )
    with torch.device("meta"):
        small, fits = TinyLM(vocab=256), TinyLM(vocab=corpus.vocab_size)
    check_vocab(corpus, fits)
    with pytest.raises(ConfigurationError, match=rf"the model's embedding has 256 rows.*at least {corpus.vocab_size}"):
        check_vocab(corpus, small)


def test_your_model_and_data_through_shardline_train(tmp_path: Path) -> None:
    """-cd folder + your model class + JSONL + a local tokenizer, on 2 workers; the data position is checkpointed."""
    from shardline.checkpoint.lifecycle.load import load_trainer_state
    from tests.train.test_cli import read_metrics, shardline_train

    tok_path = build_tokenizer(tmp_path / "tokenizer.json")
    vocab = tokenizers.Tokenizer.from_file(str(tok_path)).get_vocab_size()
    (tmp_path / "docs.jsonl").write_text("\n".join(json.dumps({"text": d * 3}) for d in DOCS))
    experiment = tmp_path / "configs" / "experiment" / "my_lm.yaml"
    experiment.parent.mkdir(parents=True)
    experiment.write_text(
        f"""# @package _global_
model:
  _target_: tests.train.user_model.TinyLM
  vocab: {vocab}
  width: 32
data:
  name: jsonl
  path: {tmp_path / "docs.jsonl"}
  tokenizer: {tok_path}
  seq_len: 16
  val_every: 6
trainer:
  init_device: meta
  strategy:
    auto_wrap_policy:
      _target_: shardline.layer_policy
      _args_: [tests.train.user_model.Layer]
"""
    )
    proc = shardline_train(
        "-cd",
        str(tmp_path / "configs"),
        "experiment=my_lm",
        "trainer.max_steps=4",
        "trainer.val_check_interval=2",
        "trainer.val_batches=1",
        "trainer.micro_batch_size=2",
        "optimizer.lr=0.01",
        "~callbacks.tensorboard",
        "~callbacks.loss_plot",
        run_root=tmp_path / "runs",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (run_dir,) = (tmp_path / "runs" / "my_lm").iterdir()
    rows = read_metrics(run_dir)
    assert [int(r["step"]) for r in rows] == [0, 1, 2, 3, 4]
    vals = [float(r["val_loss"]) for r in rows if r["val_loss"]]
    assert vals[-1] < vals[0]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert "jsonl" in summary["corpus"]
    assert "tokenizer" in summary["corpus"]
    state = load_trainer_state(run_dir / "checkpoints" / "step-4")
    assert state["data"] == {
        "position": 4,
        "seed": 1234,
        "fingerprint": summary["corpus_sha256"],
        "global_batch": 2 * 2 * 2,  # micro x accumulation x world: recorded, kept by any resume
        "world_size": 2,
    }
