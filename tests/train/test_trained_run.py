"""One small ``shardline train`` run (the Hugging Face Llama experiment, one process) that keeps its best checkpoint
by validation loss and exports at the end; what it leaves is checked here:

* best-k retention: each checkpoint's commit row records the validation loss the run logged for its step, and
  the best one plus the newest are kept;
* exports that run: the end-of-run export and ``shardline consolidate`` load with ``AutoTokenizer`` and
  ``AutoModelForCausalLM.from_pretrained`` and generate text, tokenized exactly as training did (bytes).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import shardline.checkpoint as ckpt
from shardline import cli
from shardline.train.data.tokenizer import ByteEncoder
from tests.train.test_cli import SMALL, only_run_dir, read_metrics, shardline_train


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("runs")
    small = [a for a in SMALL if not a.startswith("trainer.val_check_interval")]
    proc = shardline_train(
        "experiment=hf_llama",
        "trainer.strategy=single_device",
        "trainer.devices=1",
        *small,
        "trainer.val_check_interval=2",
        "checkpoint.every_n_steps=2",
        "checkpoint.keep_best_k=1",
        "checkpoint.monitor=val_loss",
        "+callbacks.export._target_=shardline.train.export.Export",
        run_root=root,
    )
    assert proc.returncode == 0, proc.stderr
    return only_run_dir(root)


def test_a_run_keeps_the_best_validation_loss_and_the_newest(run_dir: Path) -> None:
    val = {int(r["step"]): float(r["val_loss"]) for r in read_metrics(run_dir) if r.get("val_loss")}
    commits = [r for r in ckpt.Ledger(run_dir / "lineage.sqlite").rows() if r.is_commit]
    assert [r.step for r in commits] == [2, 4, 6]
    for row in commits:  # the value recorded is the one the run logged for that step
        assert float(json.loads(row.detail)["metrics"]["val_loss"]) == val[row.step]
    best = min((2, 4, 6), key=lambda s: (val[s], -s))
    kept = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*"))
    assert kept == sorted({f"step-{best}", "step-6"})


def test_an_exported_run_generates_text_with_from_pretrained(run_dir: Path, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    import torch

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
