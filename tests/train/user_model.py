"""A model class that is not shardline's, as a user would bring it (its own arguments, its own layer class)."""

from __future__ import annotations

import torch
from torch import nn


class Layer(nn.Module):
    """A residual MLP over the token axis' features (the wrap unit)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


class TinyLM(nn.Module):
    """Embedding, ``depth`` layers, output head: logits of shape ``(batch, seq, vocab)``."""

    def __init__(self, *, vocab: int, width: int = 32, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(Layer(width) for _ in range(depth))
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)
