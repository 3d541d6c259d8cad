"""An export carries the tokenizer its run trained with: the byte tokenizer as a real ``tokenizers`` file that
encodes exactly as training did, a ``tokenizer.json`` or a tokenizer folder copied; a tokenizer gone by then is a
warning, never a lost export."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import shardline.checkpoint as ckpt
from shardline.checkpoint.format.tokenizer_export import byte_tokenizer_json
from shardline.errors import CheckpointWarning
from shardline.train.data.tokenizer import ByteEncoder, load_encoder

tokenizers = pytest.importorskip("tokenizers")

SAMPLES = [
    "def f(x):\n\treturn x  # two spaces\n\n",
    "naïve café — 日本語 🙂 ok",
    "".join(chr(i) for i in range(128)),
    "  leading and trailing  ",
    "",
]


def _save(tmp_path: Path, config: dict | None) -> Path:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    path = tmp_path / "step-1"
    ckpt.save(path, model=model, step=1, config=config)
    return path


def _listed(out: Path) -> set[str]:
    return {line.split()[1] for line in (out / "SHA256SUMS").read_text().splitlines()}


def test_the_byte_tokenizer_file_encodes_exactly_as_training_did(tmp_path: Path) -> None:
    fast = tokenizers.Tokenizer.from_str(byte_tokenizer_json().decode())
    expected = ByteEncoder().encode_batch(SAMPLES)
    assert [e.ids for e in fast.encode_batch(SAMPLES, add_special_tokens=False)] == expected
    assert [fast.decode(ids) for ids in expected] == SAMPLES
    assert fast.get_vocab_size() == 256
    # the exported file, read back the way training reads a data.tokenizer file, encodes the same too
    (tmp_path / "tokenizer.json").write_bytes(byte_tokenizer_json())
    assert load_encoder(str(tmp_path / "tokenizer.json")).encode_batch(SAMPLES) == expected


def test_consolidate_writes_the_byte_tokenizer_of_a_run_on_bytes(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "out"
    result = ckpt.consolidate(_save(tmp_path, {"data": {"tokenizer": None, "seq_len": 32}}), out)
    assert {"tokenizer.json", "tokenizer_config.json"} <= _listed(out)
    assert {f["path"] for f in result.files} >= {"tokenizer.json", "tokenizer_config.json"}
    auto = transformers.AutoTokenizer.from_pretrained(out)
    assert [auto(s, add_special_tokens=True)["input_ids"] for s in SAMPLES] == ByteEncoder().encode_batch(SAMPLES)
    assert auto.model_max_length == 32


def test_consolidate_copies_the_runs_tokenizer_file_and_folder(tmp_path: Path) -> None:
    source = tmp_path / "tok.json"
    source.write_bytes(byte_tokenizer_json())
    out = tmp_path / "from-file"
    ckpt.consolidate(_save(tmp_path / "a", {"data": {"tokenizer": str(source)}}), out)
    assert (out / "tokenizer.json").read_bytes() == source.read_bytes()
    assert json.loads((out / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"

    folder = tmp_path / "tokenizer-folder"
    folder.mkdir()
    files = {"tokenizer.json": source.read_bytes(), "tokenizer_config.json": b'{"tokenizer_class": "X"}\n'}
    files["special_tokens_map.json"] = b"{}\n"
    for name, data in files.items():
        (folder / name).write_bytes(data)
    (folder / "config.json").write_text('{"model_type": "not this"}')  # a model's file: never copied
    out = tmp_path / "from-folder"
    ckpt.consolidate(_save(tmp_path / "b", {"data": {"tokenizer": str(folder)}}), out)
    assert {name: (out / name).read_bytes() for name in files} == files
    assert not (out / "config.json").exists()
    assert set(files) <= _listed(out)


def test_a_tokenizer_gone_by_export_time_is_a_warning_and_the_weights_are_written(tmp_path: Path) -> None:
    gone = tmp_path / "moved-away" / "tokenizer.json"
    out = tmp_path / "out"
    with pytest.warns(CheckpointWarning, match="is not there any more"):
        result = ckpt.consolidate(_save(tmp_path, {"data": {"tokenizer": str(gone)}}), out)
    assert (out / "model.safetensors").is_file()
    assert not (out / "tokenizer.json").exists()
    assert "is not there any more" in (result.note or "")


def test_no_tokenizer_for_a_checkpoint_not_saved_by_a_training_run(tmp_path: Path) -> None:
    out = tmp_path / "out"
    ckpt.consolidate(_save(tmp_path, None), out)
    assert not (out / "tokenizer.json").exists()
    ckpt.consolidate(_save(tmp_path / "c", {"lr": 0.1}), tmp_path / "out2")
    assert not (tmp_path / "out2" / "tokenizer.json").exists()
