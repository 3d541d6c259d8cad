"""The shipped experiment=hf_lora: LoRA fine-tuning through shardline train, then the exported adapter loads in PEFT."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from tests.train.test_cli import read_metrics, shardline_train

pytestmark = pytest.mark.compat  # PEFT's LoRA through shardline train, on the installed peft


def _checkpoint_tensors(step: Path, keys: list[str]) -> dict[str, torch.Tensor]:
    """The named model tensors, read from the checkpoint with torch DCP alone (an independent reader)."""
    metadata = FileSystemReader(str(step)).read_metadata()
    targets = {k: torch.empty(tuple(metadata.state_dict_metadata[f"model.{k}"].size)) for k in keys}
    dcp.load({"model": targets}, checkpoint_id=str(step), no_dist=True)
    return targets


def test_hf_lora_trains_and_exports_an_adapter_peft_loads(tmp_path: Path) -> None:
    pytest.importorskip("peft")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    proc = shardline_train(
        "experiment=hf_lora",
        "trainer.max_steps=8",
        "trainer.val_check_interval=4",
        "data.max_bytes=200000",
        "~callbacks.tensorboard",
        "~callbacks.loss_plot",
        run_root=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (run_dir,) = (tmp_path / "hf_lora").iterdir()
    rows = read_metrics(run_dir)
    vals = [float(r["val_loss"]) for r in rows if r["val_loss"]]
    assert vals[-1] < vals[0], "the adapters learn"
    assert "exported the adapter of step 8" in proc.stdout
    export = run_dir / "export"
    config = json.loads((export / "adapter" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], sorted(config["target_modules"])) == ("LORA", 8, ["q_proj", "v_proj"])
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(export / "model"), export / "adapter")
    loaded = model.state_dict()
    stored = _checkpoint_tensors(run_dir / "checkpoints" / "step-8", list(loaded))
    for key, value in loaded.items():
        assert torch.equal(value, stored[key]), key
    trained = [k for k in loaded if "lora_B" in k]
    assert len(trained) == 4
    assert all(loaded[k].abs().sum() > 0 for k in trained), "lora_B starts at zero; training moved it"
