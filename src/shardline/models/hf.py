"""Models from Hugging Face ``transformers`` (the ``[hf]`` extra), built from a config: no download."""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Sequence
from typing import Any

from torch import nn

from shardline.errors import ConfigurationError

__all__ = ["tiny_llama", "tiny_llama_lora", "tiny_llama_qlora"]


def _check_config_kwargs(config_cls: type, extra: dict[str, Any], where: str) -> None:
    """A ``PretrainedConfig`` stores unknown keyword arguments silently; refuse them with a hint instead."""
    allowed: set[str] = set(config_cls().to_dict())
    for cls in config_cls.__mro__:
        init = cls.__dict__.get("__init__")
        if init is not None:
            allowed |= {p for p in inspect.signature(init).parameters if p not in ("self", "kwargs")}
    unknown = sorted(set(extra) - allowed)
    if unknown:
        close = difflib.get_close_matches(unknown[0], sorted(allowed), n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise ConfigurationError(
            f"{where}: {config_cls.__name__} has no setting '{unknown[0]}'.{hint} Remove it or fix its spelling."
        )


def tiny_llama(
    *,
    vocab_size: int = 256,
    hidden_size: int = 64,
    intermediate_size: int = 172,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    max_position_embeddings: int = 256,
    tie_word_embeddings: bool = True,
    **extra: Any,
) -> nn.Module:
    """A randomly initialized ``LlamaForCausalLM`` with a small ``LlamaConfig``.

    Its decoder layers (``transformers.models.llama.modeling_llama.LlamaDecoderLayer``) are
    the natural wrap units. Requires ``pip install 'shardline[hf]'``.
    """
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError("the tiny_llama model needs Hugging Face transformers: pip install 'shardline[hf]'") from exc
    _check_config_kwargs(LlamaConfig, extra, "tiny_llama")
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        **extra,
    )
    return LlamaForCausalLM(config)


def tiny_llama_lora(
    *,
    r: int = 8,
    lora_alpha: int = 16,
    lora_dropout: float = 0.0,
    target_modules: Sequence[str] = ("q_proj", "v_proj"),
    **llama: Any,
) -> nn.Module:
    """:func:`tiny_llama` (``llama`` are its arguments) with LoRA adapters from ``peft`` on ``target_modules``.

    The base weights are frozen; only the adapters train. ``shardline consolidate --adapters``
    exports them as a folder ``peft.PeftModel.from_pretrained`` loads. Requires
    ``pip install 'shardline[hf]'``.
    """
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError("the tiny_llama_lora model needs peft: pip install 'shardline[hf]'") from exc
    base = tiny_llama(**llama)
    config = LoraConfig(
        r=r,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        target_modules=list(target_modules),
        task_type="CAUSAL_LM",
    )
    return get_peft_model(base, config)


def tiny_llama_qlora(
    *,
    r: int = 8,
    lora_alpha: int = 16,
    lora_dropout: float = 0.0,
    target_modules: Sequence[str] = ("q_proj", "v_proj"),
    block_size: int = 64,
    scaler_block_size: int = 8,
    **llama: Any,
) -> nn.Module:
    """:func:`tiny_llama_lora` on a 4-bit base: every linear weight of the decoder layers stored as NF4.

    The weights are quantized with torchao (``block_size`` elements per absmax block,
    ``scaler_block_size`` blocks per double-quantization group; each weight's element count must
    divide by their product) before the adapters are added, so the LoRA layers wrap 4-bit bases.
    Embeddings, norms and the output head stay in full precision. Requires
    ``pip install 'shardline[hf,qlora]'``.
    """
    from shardline.engine.nf4 import to_nf4

    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError("the tiny_llama_qlora model needs peft: pip install 'shardline[hf,qlora]'") from exc
    base = tiny_llama(**llama)
    for name, module in base.named_modules():
        if ".layers." in f".{name}." and isinstance(module, nn.Linear):
            weight = to_nf4(module.weight.detach(), block_size=block_size, scaler_block_size=scaler_block_size)
            module.weight = nn.Parameter(weight, requires_grad=False)
    config = LoraConfig(
        r=r,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        target_modules=list(target_modules),
        task_type="CAUSAL_LM",
    )
    return get_peft_model(base, config)
