"""Small models that exercise every awkward case of the engine, and the helpers tests share."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 13
DIM = 10
HIDDEN = 7
SEQ = 5
BATCH = 12  # divisible by 1, 2, 3 and 4


class Block(nn.Module):
    """LayerNorm + MLP with uneven shapes, a parameter with 2 rows (fewer than 3 or 4 ranks) and a frozen one."""

    def __init__(self, dim: int = DIM, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.gate = nn.Parameter(torch.empty(2, dim))
        self.frozen_bias = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.gate, mean=0.5, std=0.1)
        nn.init.normal_(self.frozen_bias, std=0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc2(F.gelu(self.fc1(self.norm(x))))
        return x + h * self.gate[0] + self.gate[1] + self.frozen_bias


class ParityModel(nn.Module):
    """Embedding tied to the output head, a buffer, blocks, a final LayerNorm."""

    def __init__(self, n_blocks: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(n_blocks))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("pos_scale", torch.empty(DIM))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.pos_scale.copy_(torch.linspace(0.5, 1.5, DIM))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens) * self.pos_scale
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def batch(step: int, size: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: identical on every rank."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (size, SEQ), generator=g)
    targets = torch.randint(0, VOCAB, (size, SEQ), generator=g)
    return tokens, targets


def local_slice(tensor: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    per = tensor.shape[0] // world_size
    return tensor[rank * per : (rank + 1) * per]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def max_rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``max|a - e| / max|e|`` (0 when both are all zero)."""
    actual, expected = actual.double(), expected.double()
    scale = expected.abs().max().item() if expected.numel() else 0.0
    diff = (actual - expected).abs().max().item() if expected.numel() else 0.0
    return diff / scale if scale else diff
