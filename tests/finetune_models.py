"""Models with the autograd graphs fine-tuning produces: LoRA on frozen weights, frozen units, reuse."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

DIM = 12
RANK = 4
VOCAB = 17
SEQ = 6
BATCH = 12  # divisible by 1, 2, 3 and 4


class LoraLinear(nn.Module):
    """``base(x) + B(A(x))`` with ``base`` frozen: backward needs the frozen weight for the input gradient."""

    def __init__(self, d_in: int, d_out: int, base_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.base = nn.Linear(d_in, d_out).to(base_dtype).requires_grad_(False)
        self.A = nn.Linear(d_in, RANK, bias=False)
        self.B = nn.Linear(RANK, d_out, bias=False)
        nn.init.normal_(self.B.weight, std=0.2)  # non-zero, so A gets gradients from the first step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base(x.to(self.base.weight.dtype)).to(x.dtype)
        return base + self.B(self.A(x))


class LoraBlock(nn.Module):
    """A LayerNorm whose weight is frozen (used elementwise) and two LoRA projections."""

    def __init__(self, base_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.norm.weight.requires_grad_(False)
        self.q = LoraLinear(DIM, 2 * DIM, base_dtype)
        self.out = LoraLinear(2 * DIM, DIM, base_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(F.gelu(self.q(self.norm(x))))


class FrozenBlock(nn.Module):
    """Every parameter frozen; still on the gradient path of the blocks before it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + torch.tanh(self.fc(x)))


class FineTuneNet(nn.Module):
    """Frozen embedding (the first block's input needs no gradient), a reused block, an unreached block."""

    def __init__(self, base_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM).requires_grad_(False)
        self.first = LoraBlock(base_dtype)
        self.frozen = FrozenBlock()
        self.shared = LoraBlock(base_dtype)  # run twice per forward
        self.aux = LoraBlock(base_dtype)  # its output is returned, never used by the loss
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.first(self.emb(tokens))
        x = self.frozen(x)
        x = self.shared(self.shared(x))
        return self.head(x), self.aux(x)


def forward_terms() -> int:
    """Longest chain of reductions in one forward of :class:`FineTuneNet` (see ``tests.numerics``).

    A LoRA block: LayerNorm's mean and variance over ``DIM``; ``q``'s dot products over ``DIM``
    then, for the adapter, over ``RANK``; ``out``'s over ``2 * DIM`` then ``RANK``. The frozen
    block: ``fc`` over ``DIM``, its LayerNorm over ``DIM`` twice. Chained: ``first``, ``frozen``,
    ``shared`` twice, then the head over ``DIM`` and the softmax over ``VOCAB``.
    """
    lora = 2 * DIM + (DIM + RANK) + (2 * DIM + RANK)
    frozen = DIM + 2 * DIM
    return 3 * lora + frozen + DIM + VOCAB


def lora_blocks(model: FineTuneNet) -> list[LoraBlock]:
    return [model.first, model.shared, model.aux]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def rows(tensor: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    per = tensor.shape[0] // world_size
    return tensor[rank * per : (rank + 1) * per]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor, teacher: torch.Tensor | None = None) -> torch.Tensor:
    loss = F.cross_entropy(logits.reshape(-1, VOCAB).float(), targets.reshape(-1))
    if teacher is not None:
        loss = loss + 0.1 * F.mse_loss(logits.float(), teacher.float())
    return loss


def padded_grad_bytes(params: list[torch.Tensor], world: int) -> int:
    """Bytes a reduce-scatter over ``world`` ranks moves for ``params``: torch.chunk rows, padded, full buffer."""
    total = 0
    for p in params:
        n_rows = p.shape[0] if p.dim() else 1
        total += world * math.ceil(n_rows / world) * (p.numel() // n_rows) * p.element_size()
    return total
