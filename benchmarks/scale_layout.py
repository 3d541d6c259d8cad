"""The simulated job of ``benchmarks/scale_sim.py``: a 70B Llama's state dict, sharded FULL_SHARD over W ranks.

No tensor is allocated: the parameters are a table of names and shapes generated from the published
Llama 3 70B configuration, and each rank's piece of each tensor is the row range FSDP2's ``Shard(0)``
gives it (``torch.chunk`` semantics: ``ceil(rows / W)`` rows per rank, the last ranks possibly empty).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

__all__ = [
    "LLAMA_70B",
    "LlamaConfig",
    "Tensor",
    "fake_sha256",
    "file_bytes",
    "llama_tensors",
    "rank_rows",
    "state_dict_keys",
]


@dataclass(frozen=True)
class LlamaConfig:
    """The shape-defining fields of a Llama configuration."""

    layers: int = 80
    hidden: int = 8192
    intermediate: int = 28672
    heads: int = 64
    kv_heads: int = 8
    vocab: int = 128256

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


LLAMA_70B = LlamaConfig()


@dataclass(frozen=True)
class Tensor:
    """One saved tensor: its DCP key (``model.<fqn>`` or ``optim.state.<fqn>.<state>``) and global shape."""

    key: str
    shape: tuple[int, ...]
    itemsize: int = 4  # fp32 master weights and Adam moments

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.itemsize


def llama_tensors(config: LlamaConfig = LLAMA_70B, *, layers: int | None = None) -> list[tuple[str, tuple[int, ...]]]:
    """``(parameter name, shape)`` of every parameter, as Hugging Face's ``LlamaForCausalLM`` names them.

    ``layers``: how many decoder layers to list (default: all of ``config``'s).
    """
    h, kv = config.hidden, config.kv_heads * config.head_dim
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (config.vocab, h))]
    for i in range(config.layers if layers is None else layers):
        p = f"model.layers.{i}."
        out += [
            (p + "self_attn.q_proj.weight", (h, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, h)),
            (p + "mlp.gate_proj.weight", (config.intermediate, h)),
            (p + "mlp.up_proj.weight", (config.intermediate, h)),
            (p + "mlp.down_proj.weight", (h, config.intermediate)),
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
        ]
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (config.vocab, h))]
    return out


def state_dict_keys(
    config: LlamaConfig = LLAMA_70B, *, layers: int | None = None, optimizer: bool = True
) -> list[Tensor]:
    """The tensors a sharded save writes: every parameter, and with ``optimizer`` its two Adam moments."""
    out: list[Tensor] = []
    for name, shape in llama_tensors(config, layers=layers):
        out.append(Tensor(f"model.{name}", shape))
        if optimizer:
            out += [Tensor(f"optim.state.{name}.{s}", shape) for s in ("exp_avg", "exp_avg_sq")]
    return out


def rank_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """``(first row, rows)`` of ``rank``'s piece of a tensor of ``rows`` rows sharded over ``world`` ranks."""
    chunk = -(-rows // world)
    start = min(rank * chunk, rows)
    return start, min(rows, start + chunk) - start


def file_bytes(tensors: list[Tensor], world: int, rank: int, files: int) -> list[int]:
    """The sizes of ``rank``'s ``files`` data files (its share split evenly; DCP's framing left out)."""
    share = sum(rank_rows(t.shape[0], world, rank)[1] * t.row_bytes for t in tensors)
    return [share // files + (1 if n < share % files else 0) for n in range(files)]


def fake_sha256(name: str) -> str:
    """A stand-in digest for a file that is not written (the real one would be computed while writing)."""
    return hashlib.sha256(name.encode()).hexdigest()
