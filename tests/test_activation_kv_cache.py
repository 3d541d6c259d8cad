"""Activation checkpointing on a Hugging Face decoder turns its KV cache off (use_cache=False), once."""

from __future__ import annotations

import logging

import pytest
import torch

import shardline


def test_checkpointing_hf_decoder_layers_turns_use_cache_off(caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from shardline.models.hf import tiny_llama

    torch.manual_seed(0)
    model = tiny_llama(max_position_embeddings=32)
    assert model.config.use_cache is True
    with caplog.at_level(logging.INFO, logger="shardline"):
        names = shardline.apply_activation_checkpointing(model, lambda m: isinstance(m, LlamaDecoderLayer))
    assert names == ["model.layers.0", "model.layers.1"]
    assert model.config.use_cache is False
    assert model.model.config.use_cache is False
    logged = [r.getMessage() for r in caplog.records if "use_cache=False" in r.getMessage()]
    assert len(logged) == 1, logged  # one config object (shared by the model and its decoder), one line
    assert "LlamaConfig" in logged[0], logged
    # Training forward builds no cache now, and checkpointed gradients equal plain ones.
    reference = tiny_llama(max_position_embeddings=32)
    reference.load_state_dict(model.state_dict())
    x = torch.randint(0, 256, (2, 16))
    out = model(x)
    assert getattr(out, "cache", None) is None
    out.logits.float().sum().backward()
    reference(x).logits.float().sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


def test_models_without_a_cache_setting_are_left_alone() -> None:
    from shardline.engine.activation import disable_kv_cache

    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    model.config = type("Config", (), {"hidden": 2})()  # a config with no use_cache
    assert disable_kv_cache(model) == []
    assert not hasattr(model.config, "use_cache")
