"""A small decoder-only transformer (GPT-style), the default model of ``shardline train``.

Every module initializes its own parameters in ``reset_parameters()``, so the model can be
built on the meta device, sharded, and materialized bit-identically to a CPU build.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "Block", "GPTConfig"]


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a :class:`GPT`.

    Attributes:
        vocab_size: Number of token ids (256 for bytes).
        seq_len: Longest sequence the position embedding covers.
        dim: Width of the residual stream.
        n_layers: Number of transformer blocks (the wrap units).
        n_heads: Attention heads; must divide ``dim``.
        mlp_ratio: Hidden width of the MLP as a multiple of ``dim``.
        dropout: Dropout probability on attention and MLP outputs.
        tie_embeddings: Share the token embedding with the output head.
    """

    vocab_size: int = 256
    seq_len: int = 128
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    mlp_ratio: int = 4
    dropout: float = 0.0
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"GPTConfig: dim={self.dim} must be divisible by n_heads={self.n_heads}")
        for name in ("vocab_size", "seq_len", "dim", "n_layers", "n_heads", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig: {name} must be >= 1, got {getattr(self, name)}")

    @property
    def num_params(self) -> int:
        """Parameter count (tied embeddings counted once)."""
        d, h = self.dim, self.mlp_ratio * self.dim
        block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * h + h) + (h * d + d)
        head = 0 if self.tie_embeddings else self.vocab_size * d
        return self.vocab_size * d + self.seq_len * d + self.n_layers * block + 2 * d + head


class TokenEmbedding(nn.Embedding):
    """Embedding initialized N(0, 0.02), so a tied output head starts with small logits."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        out: torch.Tensor = self.proj(y.transpose(1, 2).reshape(b, t, d))
        return out


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.dim, cfg.mlp_ratio * cfg.dim)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.proj(F.gelu(self.fc(x)))
        return out


class Block(nn.Module):
    """Pre-norm transformer block: the unit shardline shards and checkpoints."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        out: torch.Tensor = x + self.drop(self.mlp(self.ln2(x)))
        return out


class GPT(nn.Module):
    """Token + position embeddings, ``n_layers`` blocks, final LayerNorm, (tied) output head."""

    def __init__(self, cfg: GPTConfig | None = None, **overrides: object) -> None:
        super().__init__()
        cfg = cfg or GPTConfig(**overrides)  # type: ignore[arg-type]
        self.config = cfg
        self.tok_emb = TokenEmbedding(cfg.vocab_size, cfg.dim)
        self.pos_emb = TokenEmbedding(cfg.seq_len, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of shape ``(batch, seq, vocab)`` for token ids of shape ``(batch, seq)``."""
        t = tokens.shape[1]
        if t > self.config.seq_len:
            raise ValueError(f"sequence length {t} exceeds the model's seq_len={self.config.seq_len}")
        positions = torch.arange(t, device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.head(self.ln_f(x))
        return out
