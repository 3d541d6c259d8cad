"""Small models that exercise every awkward case of the engine, and the helpers tests share."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import shardline
from tests.numerics import max_rel_err

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


BLOCK_TERMS = 2 * DIM + DIM + HIDDEN
"""Longest chain of reductions in one :class:`Block`: LayerNorm's mean and variance over ``DIM``,
fc1's dot products over ``DIM``, fc2's over ``HIDDEN`` (see ``tests.numerics``)."""


def parity_forward_terms(n_blocks: int = 2) -> int:
    """Longest chain of reductions in one forward of :class:`ParityModel` (see ``tests.numerics``).

    Its blocks, then the final LayerNorm, the head's dot products over ``DIM`` and the softmax's
    sum over ``VOCAB``.
    """
    return n_blocks * BLOCK_TERMS + 2 * DIM + DIM + VOCAB


def chain_terms(*, forward: int, tokens: int, world_size: int, micro: int = 1) -> int:
    """Longest chain of reductions behind one gradient element of a data-parallel step.

    The forward's chain (``forward``), backward mirroring it, the mean loss's and the weight
    gradient's sums over the global batch's ``tokens``, the accumulation of ``micro``
    micro-batches and the average across ``world_size`` ranks.
    """
    return 2 * forward + 2 * tokens + micro + world_size


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """A sharded model's full gradients by name (zeros where none), gathered like its parameters.

    A collective: every rank calls it. Loads each shard's gradient into the parameter, gathers a
    full state dict, and puts the parameters back.
    """
    saved = [(p, p.detach().clone()) for p in model.parameters()]
    with torch.no_grad():
        for p, _ in saved:
            p.copy_(p.grad if p.grad is not None else torch.zeros_like(p))
    grads = shardline.full_state_dict(model)
    with torch.no_grad():
        for p, value in saved:
            p.copy_(value)
    return grads


def grad_errors(model: nn.Module, reference: nn.Module) -> dict[str, float]:
    """Relative error (``tests.numerics.max_rel_err``) of each of ``model``'s full gradients against ``reference``'s.

    A collective (see :func:`full_grads`).
    """
    full = full_grads(model)
    return {n: max_rel_err(full[n], p.grad) for n, p in reference.named_parameters() if p.grad is not None}
