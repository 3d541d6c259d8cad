"""Rank functions for the Hugging Face / PEFT export tests (module level, so the harness can pickle them)."""

from __future__ import annotations

import os
import warnings

import torch

import shardline
import shardline.checkpoint as ckpt
from tests.checkpoint.ranks import pack

LLAMA = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32,
}
DECODER_LAYER = "transformers.models.llama.modeling_llama.LlamaDecoderLayer"


def lora_model(base_dtype: torch.dtype = torch.float32):
    """A tiny Llama with LoRA adapters; the frozen base weights in ``base_dtype``, the adapters fp32."""
    from shardline.models.hf import tiny_llama_lora

    warnings.simplefilter("ignore", FutureWarning)
    torch.manual_seed(0)
    model = tiny_llama_lora(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], **LLAMA)
    for name, param in model.named_parameters():
        if "lora_" not in name:
            param.data = param.data.to(base_dtype)
    return model


def train_lora_and_save(
    rank: int, world: int, root: str, strategy: str, base_dtype: torch.dtype = torch.float32
) -> dict[str, bytes]:
    """Train LoRA adapters 2 steps, save a checkpoint, and -- as references -- PEFT's own save_pretrained outputs.

    Returns (rank 0) the full state dict, packed. ``root/ckpt`` is the checkpoint; ``root/peft_ref``
    is what PEFT writes from an unsharded copy; ``root/save_pretrained`` what PEFT writes from the
    sharded model given the gathered state dict (the route docs/huggingface.md describes).
    """
    model = lora_model(base_dtype)
    if strategy != "none":  # "none": unsharded, to check the test itself where sharding is not available yet
        shardline.wrap(model, shardline.layer_policy(DECODER_LAYER), strategy=strategy)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    generator = torch.Generator().manual_seed(1)
    for _ in range(2):
        tokens = torch.randint(0, LLAMA["vocab_size"], (2 * world, 16), generator=generator)
        mine = tokens.chunk(world)[rank]
        logits = model(input_ids=mine).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), mine[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    ckpt.save(os.path.join(root, "ckpt"), model=model, optimizer=optimizer, step=2)
    full = shardline.full_state_dict(model, rank0_only=True) if strategy != "none" else model.state_dict()
    if rank == 0:
        model.save_pretrained(os.path.join(root, "save_pretrained"), state_dict=full)
        reference = lora_model(base_dtype)
        reference.load_state_dict(full)
        reference.save_pretrained(os.path.join(root, "peft_ref"))
    torch.distributed.barrier()
    return {"full": pack(full)}


def save_llama_and_save_pretrained(rank: int, world: int, root: str) -> dict[str, bytes]:
    """``ranks.save_llama`` (checkpoints), then the save_pretrained route of docs/huggingface.md on a sharded Llama.

    Rank 0 writes ``root/save_pretrained`` from a meta-device twin given the gathered state dict.
    """
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from tests.checkpoint.ranks import save_llama

    saved = save_llama(rank, world, root)
    torch.manual_seed(3)
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in LLAMA.items() if k != "max_position_embeddings"}))
    shardline.wrap(model, shardline.layer_policy(DECODER_LAYER))
    full = shardline.full_state_dict(model, rank0_only=True)  # a collective: every rank calls it
    if rank == 0:
        with torch.device("meta"):  # an unsharded twin without memory: config.json names its class
            twin = AutoModelForCausalLM.from_config(model.config)
        twin.save_pretrained(os.path.join(root, "save_pretrained"), state_dict=full)
    torch.distributed.barrier()
    return {**saved, "save_pretrained": pack(full)}
