"""Models from Hugging Face ``transformers`` (the ``[hf]`` extra), built from a config: no download."""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["tiny_llama"]


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
