"""The shipped experiment=hf_qlora: LoRA on a 4-bit NF4 base through shardline train; PEFT loads the adapter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from tests.numerics import assert_trajectory, close_ratio
from tests.train.test_cli import read_metrics, shardline_train

pytestmark = pytest.mark.compat  # PEFT's LoRA over torchao's NF4 through shardline train, on the installed versions

# The experiment's model settings (src/shardline/train/conf/experiment/hf_qlora.yaml) and the trainer's default seed.
MODEL = {
    "r": 8,
    "lora_alpha": 16,
    "target_modules": ["q_proj", "v_proj"],
    "block_size": 64,
    "scaler_block_size": 8,
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}
SEED = 1234


def _checkpoint_tensors(step: Path) -> dict[str, torch.Tensor]:
    """Every model tensor of the checkpoint, read with torch DCP alone (an independent reader)."""
    metadata = FileSystemReader(str(step)).read_metadata()
    targets = {
        k.removeprefix("model."): torch.empty(tuple(m.size))  # type: ignore[union-attr]
        for k, m in metadata.state_dict_metadata.items()
        if k.startswith("model.")
    }
    dcp.load({"model": targets}, checkpoint_id=str(step), no_dist=True)
    return targets


def test_hf_qlora_trains_and_exports_an_adapter_peft_loads_over_the_4bit_base(tmp_path: Path) -> None:
    pytest.importorskip("peft")
    pytest.importorskip("torchao")
    from peft import PeftModel

    from shardline.engine.nf4 import is_nf4
    from shardline.models.hf import tiny_llama_qlora

    proc = shardline_train(
        "experiment=hf_qlora",
        "trainer.max_steps=6",
        "trainer.val_check_interval=3",
        "data.max_bytes=200000",
        "~callbacks.tensorboard",
        "~callbacks.loss_plot",
        run_root=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (run_dir,) = (tmp_path / "hf_qlora").iterdir()
    vals = [float(r["val_loss"]) for r in read_metrics(run_dir) if r["val_loss"]]
    assert vals[-1] < vals[0], "the adapters learn"
    assert "exported the adapter of step 6" in proc.stdout
    adapter = run_dir / "export" / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], sorted(config["target_modules"])) == ("LORA", 8, ["q_proj", "v_proj"])

    stored = _checkpoint_tensors(run_dir / "checkpoints" / "step-6")
    assert not any("proj.weight" in k or "base_layer" in k for k in stored), "the 4-bit base stays out of checkpoints"
    # The trained model, rebuilt: the run's 4-bit base (the same seed; its full-precision weights in the
    # checkpoint confirm it) with the checkpoint's adapters.
    torch.manual_seed(SEED)
    trained = tiny_llama_qlora(**MODEL)
    own = trained.state_dict()
    embed = "base_model.model.model.embed_tokens.weight"
    assert torch.equal(own[embed], stored[embed]), "the rebuilt base is not the run's"
    assert sum(is_nf4(p) for p in trained.parameters()) == 14
    lora = {k: v for k, v in stored.items() if "lora_" in k}
    assert len(lora) == 8
    assert all(v.abs().sum() > 0 for k, v in lora.items() if "lora_B" in k), "lora_B starts at zero; training moved it"
    _missing, unexpected = trained.load_state_dict(lora, strict=False)
    assert not unexpected

    torch.manual_seed(SEED)
    base = tiny_llama_qlora(**MODEL).unload()  # the same 4-bit base, without adapters
    loaded = PeftModel.from_pretrained(base, adapter)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = trained(input_ids=tokens).logits
        actual = loaded(input_ids=tokens).logits
        with loaded.disable_adapter():
            without = loaded(input_ids=tokens).logits
    assert close_ratio(without, expected) > 10, "the comparison below could not tell the adapter from none"
    # The same operations on the same values; allow assert_close's fp32 defaults.
    assert_trajectory(close_ratio(actual, expected), "logits of the exported adapter over the 4-bit base")


def test_a_resume_of_hf_qlora_expects_no_4bit_weight_in_the_checkpoint() -> None:
    """The launcher's fit check before a resume compares the checkpoint with the model less its NF4 weights."""
    pytest.importorskip("peft")
    pytest.importorskip("torchao")
    from shardline.train.build import build_model
    from shardline.train.config import compose_config, to_train_config
    from shardline.train.preflight import _fit_problems

    cfg = to_train_config(compose_config(["experiment=hf_qlora"]))
    model = build_model(cfg, device="meta")
    # What a checkpoint of the run holds: everything but the decoder layers' linear weights (named, not detected).
    stored = {
        k: (tuple(v.shape), str(v.dtype).removeprefix("torch."))
        for k, v in model.state_dict(keep_vars=True).items()
        if not k.endswith(("proj.weight", "proj.base_layer.weight"))
    }
    assert len(stored) == len(model.state_dict()) - 14
    assert _fit_problems(cfg, stored) == []
