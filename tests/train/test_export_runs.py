"""The end-of-run export and ``shardline consolidate`` of a trained run load with ``from_pretrained`` and generate:
weights, config and the tokenizer the run trained with (bytes) side by side."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardline import cli
from shardline.train.data.tokenizer import ByteEncoder
from tests.train.test_cli import SMALL, only_run_dir, shardline_train


def test_an_exported_run_generates_text_with_from_pretrained(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    import torch

    proc = shardline_train(
        "experiment=hf_llama",
        "trainer.strategy=single_device",
        "trainer.devices=1",
        *SMALL,
        "+callbacks.export._target_=shardline.train.export.Export",
        run_root=tmp_path / "runs",
    )
    assert proc.returncode == 0, proc.stderr
    run_dir = only_run_dir(tmp_path / "runs")
    exported = run_dir / "export" / "model"
    again = tmp_path / "consolidated"
    assert cli.main(["consolidate", str(run_dir / "checkpoints" / "step-6"), str(again)]) == 0
    assert (again / "tokenizer.json").read_bytes() == (exported / "tokenizer.json").read_bytes()
    for out in (exported, again):
        tokenizer = transformers.AutoTokenizer.from_pretrained(out)
        model = transformers.AutoModelForCausalLM.from_pretrained(out)
        prompt = "def main():\n    "
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        assert ids[0].tolist() == ByteEncoder().encode_batch([prompt])[0], "the ids training saw"
        with torch.no_grad():
            generated = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
        assert generated.shape[1] == ids.shape[1] + 12
        text = tokenizer.decode(generated[0], skip_special_tokens=True)
        assert text.startswith(prompt)
        assert len(text.encode("utf-8", errors="replace")) >= len(prompt.encode())
