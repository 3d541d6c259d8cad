"""A stand-in module with an :class:`~.architecture.Architecture`'s parameters and activations.

The memory estimator (:mod:`shardline.diagnostics.estimate`) needs a module to build on fake
tensors; an HF config names a model class shardline does not import, so the planner builds
this one: the same projections, norms and MLP, attention through
``F.scaled_dot_product_attention`` (a flash kernel: it saves its output and the log-sum-exp,
never the ``seq x seq`` scores), grouped-query attention by the kernel itself (``enable_gqa``).
Rotary position embeddings are left out (no parameters; a few elementwise activations per layer).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardline.diagnostics.plan.architecture import Architecture

__all__ = ["ProxyBlock", "ProxyDecoder", "ProxyMLP"]


def _norm(arch: Architecture) -> nn.Module:
    return nn.RMSNorm(arch.dim) if arch.rms_norm else nn.LayerNorm(arch.dim)


class ProxyMLP(nn.Module):
    """SwiGLU (three projections) or GELU (two) MLP: what ``selective`` checkpointing recomputes."""

    def __init__(self, arch: Architecture) -> None:
        super().__init__()
        self.gated = arch.gated_mlp
        self.up = nn.Linear(arch.dim, arch.ffn_dim, bias=arch.bias)
        self.gate = nn.Linear(arch.dim, arch.ffn_dim, bias=arch.bias) if arch.gated_mlp else None
        self.down = nn.Linear(arch.ffn_dim, arch.dim, bias=arch.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor
        if self.gate is not None:
            out = self.down(F.silu(self.gate(x)) * self.up(x))
        else:
            out = self.down(F.gelu(self.up(x)))
        return out


class ProxyBlock(nn.Module):
    """One pre-norm decoder block: the unit the planner shards and ``full`` checkpointing recomputes."""

    def __init__(self, arch: Architecture) -> None:
        super().__init__()
        self.heads, self.kv_heads = arch.n_heads, arch.n_kv_heads
        self.norm1, self.norm2 = _norm(arch), _norm(arch)
        self.q = nn.Linear(arch.dim, arch.dim, bias=arch.bias)
        self.k = nn.Linear(arch.dim, arch.kv_dim, bias=arch.bias)
        self.v = nn.Linear(arch.dim, arch.kv_dim, bias=arch.bias)
        self.o = nn.Linear(arch.dim, arch.dim, bias=arch.bias)
        self.mlp = ProxyMLP(arch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.norm1(x)
        hd = d // self.heads
        q = self.q(h).view(b, t, self.heads, hd).transpose(1, 2)
        k = self.k(h).view(b, t, self.kv_heads, hd).transpose(1, 2)
        v = self.v(h).view(b, t, self.kv_heads, hd).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, d))
        out: torch.Tensor = x + self.mlp(self.norm2(x))
        return out


class ProxyDecoder(nn.Module):
    """Embeddings, ``n_layers`` :class:`ProxyBlock`, final norm, (tied) output head."""

    def __init__(self, arch: Architecture, *, n_layers: int | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(arch.vocab_size, arch.dim)
        self.pos = nn.Embedding(arch.max_positions, arch.dim) if arch.max_positions else None
        self.blocks = nn.ModuleList(ProxyBlock(arch) for _ in range(arch.n_layers if n_layers is None else n_layers))
        self.norm = _norm(arch)
        self.head = nn.Linear(arch.dim, arch.vocab_size, bias=False)
        if arch.tied_embeddings:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``(batch, seq, vocab)`` of token ids ``(batch, seq)``."""
        x = self.embed(tokens)
        if self.pos is not None:
            x = x + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.head(self.norm(x))
        return out
