"""Hugging Face end to end: configs recorded at save, from_pretrained on the export, PEFT adapters, one-file export."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from shardline import cli
from shardline.checkpoint import consolidate
from shardline.checkpoint.integrity.manifest import read_manifest
from shardline.errors import CheckpointExistsError, ConfigurationError
from shardline.testing import run_distributed
from tests.checkpoint import hf_ranks, ranks

transformers = pytest.importorskip("transformers")


def test_transformers_config_is_recorded_and_from_pretrained_loads(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, GenerationConfig

    saved = run_distributed(hf_ranks.save_llama_and_save_pretrained, 2, args=(str(tmp_path),), timeout=90)[0]
    # The save_pretrained route for a sharded model (docs/huggingface.md): gathered state dict, meta-device twin.
    routed = AutoModelForCausalLM.from_pretrained(tmp_path / "save_pretrained")
    assert json.loads((tmp_path / "save_pretrained" / "config.json").read_text())["architectures"] == [
        "LlamaForCausalLM"
    ]
    expected = ranks.unpack(saved.pop("save_pretrained"))
    assert all(torch.equal(routed.state_dict()[k], v) for k, v in expected.items())
    for path, packed in saved.items():
        full = ranks.unpack(packed)
        out = tmp_path / f"hf-{Path(path).name}"
        result = consolidate(path, out)
        assert {"config.json", "generation_config.json"} <= {p.name for p in out.iterdir()}
        assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
        model = AutoModelForCausalLM.from_pretrained(out)
        assert type(model).__name__ == "LlamaForCausalLM"
        loaded = model.state_dict()
        assert set(loaded) == set(full)
        for key, value in full.items():
            assert torch.equal(loaded[key], value), key
        assert GenerationConfig.from_pretrained(out).eos_token_id == model.config.eos_token_id
        if path.endswith("True"):
            assert result.aliases == {"lm_head.weight": "model.embed_tokens.weight"}
            assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        else:
            assert result.aliases == {}
    # One file: OUT.safetensors is that file, with the source's manifest hash inside; nothing else is written.
    step = next(p for p in saved if p.endswith("False"))
    target = tmp_path / "single" / "model.safetensors"
    assert cli.main(["consolidate", step, str(target)]) == 0
    assert sorted(p.name for p in target.parent.iterdir()) == ["model.safetensors"]
    assert load_file(target).keys() == load_file(tmp_path / "hf-tied-False" / "model.safetensors").keys()
    for key, value in load_file(target).items():
        assert torch.equal(value, ranks.unpack(saved[step])[key]), key
    with safe_open(target, "pt") as f:
        assert f.metadata()["shardline_source_manifest_sha256"] == read_manifest(step)[1]
        assert f.metadata()["shardline_step"] == "1"
    with pytest.raises(CheckpointExistsError, match="already exists"):
        consolidate(step, target)
    # ...and a directory of that name only with --max-shard-size.
    sharded = consolidate(step, tmp_path / "dir" / "model.safetensors", max_shard_size="20KB")
    assert sharded.out.is_dir()
    assert (sharded.out / "model.safetensors.index.json").is_file()
    with pytest.raises(ConfigurationError, match="--adapters exports PEFT adapters, but this checkpoint holds a "):
        consolidate(step, tmp_path / "nope", adapters=True)


def _check_lora_export(tmp_path: Path, full: dict[str, torch.Tensor]) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    step = tmp_path / "ckpt"
    adapter, base = tmp_path / "adapter", tmp_path / "base"
    assert cli.main(["consolidate", str(step), str(adapter), "--adapters"]) == 0
    assert cli.main(["consolidate", str(step), str(base)]) == 0
    # The adapter folder holds what PEFT's own save_pretrained writes: same names, same tensors, same config.
    reference = load_file(tmp_path / "peft_ref" / "adapter_model.safetensors")
    exported = load_file(adapter / "adapter_model.safetensors")
    assert exported.keys() == reference.keys()
    assert len(exported) == 2 * 2 * 2  # 2 layers x (q_proj, v_proj) x (lora_A, lora_B)
    for key, value in reference.items():
        assert torch.equal(exported[key], value), key
    ours = json.loads((adapter / "adapter_config.json").read_text())
    theirs = json.loads((tmp_path / "peft_ref" / "adapter_config.json").read_text())
    for key in ("peft_type", "task_type", "r", "lora_alpha", "inference_mode", "bias", "use_dora"):
        assert ours[key] == theirs[key], key
    assert sorted(ours["target_modules"]) == sorted(theirs["target_modules"])
    # The base export loads with transformers; with the adapter on top it is the trained model.
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter)
    loaded = model.state_dict()
    assert set(loaded) == set(full)
    for key, value in full.items():
        assert torch.equal(loaded[key].to(value.dtype), value), key  # a bf16 base may load as fp32: exact
    # The route for other adapters: save_pretrained on the sharded model, given the gathered state dict.
    routed = load_file(tmp_path / "save_pretrained" / "adapter_model.safetensors")
    assert routed.keys() == reference.keys()
    assert all(torch.equal(routed[k], reference[k]) for k in reference)


def test_peft_adapters_export_no_shard(tmp_path: Path) -> None:
    pytest.importorskip("peft")
    result = run_distributed(hf_ranks.train_lora_and_save, 2, args=(str(tmp_path), "no_shard"), timeout=110)
    full = ranks.unpack(result[0]["full"])
    assert any(k.endswith("lora_B.default.weight") and v.abs().sum() > 0 for k, v in full.items()), "adapters trained"
    _check_lora_export(tmp_path, full)


def test_peft_adapters_export_full_shard(tmp_path: Path) -> None:
    pytest.importorskip("peft")
    result = run_distributed(hf_ranks.train_lora_and_save, 2, args=(str(tmp_path), "full_shard"), timeout=110)
    _check_lora_export(tmp_path, ranks.unpack(result[0]["full"]))


def test_peft_adapters_export_bf16_base_fp32_adapters(tmp_path: Path) -> None:
    """A frozen bf16 base with fp32 LoRA adapters in one unit (FULL_SHARD, 2 ranks): the adapter exports in fp32."""
    pytest.importorskip("peft")
    args = (str(tmp_path), "full_shard", torch.bfloat16)
    result = run_distributed(hf_ranks.train_lora_and_save, 2, args=args, timeout=110)
    full = ranks.unpack(result[0]["full"])
    assert full["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"].dtype == torch.bfloat16
    _check_lora_export(tmp_path, full)
    assert all(t.dtype == torch.float32 for t in load_file(tmp_path / "adapter" / "adapter_model.safetensors").values())
