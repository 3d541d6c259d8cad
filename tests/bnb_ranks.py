"""Rank functions and a tiny model for the bitsandbytes 4-bit base tests (tests/test_qlora_bnb.py).

The same shape of model as tests/qlora_ranks.py (two pre-norm blocks: LoRA projections over
frozen 4-bit bases, a 4-bit MLP down projection), with its bases bitsandbytes ``Linear4bit``
layers of every storage variant: nf4 and fp4, with and without double quantization. Training,
gradient gathering and the check switch come from tests/qlora_ranks.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import bitsandbytes as bnb
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardline
from shardline.engine import quantized as quantized_module
from shardline.errors import ShardingError
from tests import qlora_ranks as qr

# Double quantization groups 256 blocks of BLOCK elements (16,384): a 256 x 256 weight has 4 such groups, a
# 256 x 512 one 8; without it a group is one block (1,024 and 2,048 of them).
DIM, HIDDEN, RANK, BLOCK = 256, 512, 4, 64
VOCAB = qr.VOCAB
# (quant_type, compress_statistics) of each 4-bit weight: every variant appears.
FORMATS = {
    "blocks.0.attn.base.weight": ("nf4", True),
    "blocks.0.up.base.weight": ("nf4", False),
    "blocks.0.down.weight": ("fp4", True),
    "blocks.1.attn.base.weight": ("fp4", False),
    "blocks.1.up.base.weight": ("nf4", True),
    "blocks.1.down.weight": ("fp4", False),
}


class LoraLinear(nn.Module):
    """A frozen base (made 4-bit by :func:`build`) plus a trainable low-rank adapter ``B(A(x))``."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.base: nn.Module = nn.Linear(d_in, d_out, bias=False)
        self.A = nn.Linear(d_in, RANK, bias=False)
        self.B = nn.Linear(RANK, d_out, bias=False)
        nn.init.normal_(self.B.weight, std=0.2)  # non-zero, so A gets gradients from the first step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.B(self.A(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.attn = LoraLinear(DIM, DIM)
        self.up = LoraLinear(DIM, HIDDEN)
        self.down: nn.Module = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(self.norm(x))
        return h + self.down(F.gelu(self.up(h)))


class TinyBnb(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _four_bit(linear: nn.Linear, quant_type: str, compress: bool) -> nn.Module:
    """``linear`` as a bitsandbytes Linear4bit, quantized the way bitsandbytes does it (on ``.to(device)``)."""
    layer = bnb.nn.Linear4bit(
        linear.in_features, linear.out_features, bias=False, quant_type=quant_type, compress_statistics=compress
    )
    layer.weight = bnb.nn.Params4bit(
        linear.weight.detach().clone(),
        requires_grad=False,
        blocksize=BLOCK,
        quant_type=quant_type,
        compress_statistics=compress,
        module=layer,
    )
    return layer.to("cpu")


def build() -> TinyBnb:
    """The same model on every call: bitsandbytes 4-bit bases, frozen embedding/norms/head, trainable adapters."""
    torch.manual_seed(0)
    model = TinyBnb()
    for p in model.parameters():
        p.requires_grad_(False)
    for name, (quant_type, compress) in FORMATS.items():
        path = name.removesuffix(".weight")
        parent, _, attr = path.rpartition(".")
        setattr(model.get_submodule(parent), attr, _four_bit(model.get_submodule(path), quant_type, compress))
    for block in model.blocks:
        for lora in (block.attn, block.up):
            lora.A.weight.requires_grad_(True)
            lora.B.weight.requires_grad_(True)
    return model


def four_bit_bytes(model: nn.Module) -> int:
    """Bytes of every 4-bit weight's packed codes and absmax state (from the format, not the engine).

    Without double quantization: ``n/2`` code bytes and one float32 absmax per block. With it: one
    uint8 absmax code per block and one float32 per 256 blocks.
    """
    total = 0
    for name, (_, compress) in FORMATS.items():
        layer = model.get_submodule(name.removesuffix(".weight"))
        numel = layer.in_features * layer.out_features
        blocks = numel // BLOCK
        total += numel // 2 + (blocks + (blocks // 256) * 4 if compress else blocks * 4)
    return total


def shard(model: nn.Module, group: dist.ProcessGroup) -> nn.Module:
    return shardline.wrap(model, shardline.layer_policy(Block), mesh=group)


@contextlib.contextmanager
def dropped_absmax() -> Iterator[None]:
    """Fault: while sharding, each weight's absmax state is replaced by ones (its scale state lost)."""
    original = quantized_module._quantized_parts

    def faulty(tensor: Any, layout: Any, start: int, count: int) -> tuple[torch.Tensor, ...]:
        data, absmax, *rest = original(tensor, layout, start, count)
        return (data, torch.ones_like(absmax), *rest)

    quantized_module._quantized_parts = faulty  # type: ignore[assignment]
    try:
        yield
    finally:
        quantized_module._quantized_parts = original  # type: ignore[assignment]


def _refusal(model: nn.Module) -> str | None:
    try:
        qr.loss_of(model, *qr.batch())
    except ShardingError as exc:
        return str(exc)
    return None


def parity(rank: int, world: int) -> dict[str, Any]:
    """One launch of 4 ranks: sharded runs at W=1, 2, 4 (process groups), the plain reference, and the faults."""
    assert world == 4
    singles = [dist.new_group([r]) for r in range(4)]
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    groups = {1: singles[rank], 2: pairs[rank // 2], 4: dist.group.WORLD}
    out: dict[str, Any] = {}
    reference = build()
    out["four_bit_bytes"] = four_bit_bytes(reference)
    out["reference"] = qr.train(reference, None)
    out["adapters"] = qr.adapter_names(reference)
    for size, group in groups.items():
        model = shard(build(), group)
        if size == 4:
            registered = dict(model.named_parameters())
            out["shard_types"] = {n: type(registered[n]).__name__ for n in FORMATS}
            out["state_dict_keys"] = sorted(model.state_dict())
            owners = [model.get_submodule(n.removesuffix(".weight")) for n in FORMATS]
            out["owner_states"] = [type(getattr(m, "quant_state", None)).__name__ for m in owners]
        out[f"run{size}"] = qr.train(model, group)
        if size == 4:
            stats = shardline.memory_stats(model)
            out["memory"] = {"quantized": stats.quantized_params, "unsharded": stats.unsharded_params}
    # A Params4bit that lost its quant_state before wrapping (the state FSDP2 drops): refused by name at wrap.
    lost = build()
    lost.blocks[0].up.base.weight.quant_state = None
    try:
        shard(lost, dist.group.WORLD)
        out["lost_at_wrap"] = None
    except ShardingError as exc:
        out["lost_at_wrap"] = str(exc)
    # The absmax state dropped while sharding: refused by the pre-step check, naming every weight.
    with dropped_absmax():
        out["refused"] = _refusal(shard(build(), dist.group.WORLD))
    # On rank 1, a weight replaced after wrapping by a plain Parameter of its bytes (what FSDP2 registers).
    replaced = shard(build(), dist.group.WORLD)
    if rank == 1:
        layer = replaced.blocks[1].up.base
        layer._parameters["weight"] = nn.Parameter(layer.weight.data, requires_grad=False)
    out["replaced"] = _refusal(replaced)
    # On rank 2, the registered shard's quant_state dropped after wrapping (the state axolotl's FSDP2 runs lose).
    dropped = shard(build(), dist.group.WORLD)
    if rank == 2:
        dropped.blocks[0].down.weight.quant_state = None
    out["dropped_after_wrap"] = _refusal(dropped)
    with dropped_absmax():
        unchecked = shard(build(), dist.group.WORLD)
    with qr.check_disabled():
        out["faulty_run"] = qr.train(unchecked, dist.group.WORLD)
    out["hf"] = hf_parity(rank, groups)
    return out


class _Logits(nn.Module):
    """A Hugging Face causal LM as ``tokens -> logits`` (what tests/qlora_ranks.py's training loop calls)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.model(input_ids=tokens).logits
        return logits


def build_hf(folder: str) -> nn.Module:
    """A tiny Llama loaded in 4 bits through transformers' BitsAndBytesConfig, with PEFT LoRA adapters."""
    from peft import LoraConfig, get_peft_model
    from transformers import BitsAndBytesConfig, LlamaForCausalLM

    quantization = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
    )
    base = LlamaForCausalLM.from_pretrained(folder, quantization_config=quantization, device_map="cpu")
    torch.manual_seed(2)
    lora = LoraConfig(r=RANK, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "up_proj"])
    return _Logits(get_peft_model(base, lora))


def hf_parity(rank: int, groups: dict[int, dist.ProcessGroup]) -> dict[str, Any]:
    """Losses of the 4-bit tiny Llama + LoRA: one process, and sharded by decoder layer at W=2 and W=4."""
    import tempfile

    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=DIM,
        intermediate_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
    )
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as mine:
        shared: list[Any] = [mine]
        dist.broadcast_object_list(shared, src=0)  # transformers saves on the main process only: rank 0's folder
        folder = str(shared[0])
        if rank == 0:
            torch.manual_seed(0)
            LlamaForCausalLM(config).save_pretrained(folder)
        dist.barrier()
        reference = build_hf(folder)
        out["kinds"] = sorted({type(p).__name__ for p in reference.parameters()})
        # Bytes of each 4-bit weight by the format: packed codes (uint8), absmax codes (uint8), nested absmax (fp32).
        states = [p.quant_state for p in reference.parameters() if type(p).__name__ == "Params4bit"]
        codes = sum(torch.Size(s.shape).numel() // 2 for s in states)
        out["four_bit"] = (codes + sum(s.absmax.numel() + 4 * s.state2.absmax.numel() for s in states), len(states))
        out["reference"] = qr.train(reference, None)[0]
        for size in (2, 4):
            model = shardline.wrap(build_hf(folder), shardline.layer_policy(LlamaDecoderLayer), mesh=groups[size])
            out[f"run{size}"] = qr.train(model, groups[size])[0]
            if size == 4:
                out["quantized"] = shardline.memory_stats(model).quantized_params
        dist.barrier()  # rank 0's folder outlives every rank's loading
    return out
