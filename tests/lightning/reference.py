"""The model, data and a plain one-process torch loop: the reference the Lightning runs are compared with."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SAMPLES = 64
LOCAL_BATCH = 8  # per rank at W=2: a global batch of 16, 4 steps per epoch
LR = 0.05
CLIP = 0.1  # below the gradient norms of the first steps, so clipping is active


class Block(nn.Module):
    """The wrap unit."""

    def __init__(self, fan_in: int, fan_out: int) -> None:
        super().__init__()
        self.fc = nn.Linear(fan_in, fan_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


def build_net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(Block(8, 16), Block(16, 8), nn.Linear(8, 1))


def dataset() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(42)
    x = torch.randn(SAMPLES, 8, generator=g)
    y = (x[:, :1] * 2.0 - x[:, 1:2]).sin() + 0.1 * torch.randn(SAMPLES, 1, generator=g)
    return x, y


def loss_fn(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(net(x), y)


def train_reference(
    *, epochs: int, clip: float | None, global_batch: int = 2 * LOCAL_BATCH
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process, the whole global batch, torch's own clip_grad_norm_; returns (weights, grad norms per step)."""
    net = build_net()
    optimizer = torch.optim.AdamW(net.parameters(), lr=LR)
    x, y = dataset()
    norms = []
    for _ in range(epochs):
        for start in range(0, SAMPLES, global_batch):
            loss = loss_fn(net, x[start : start + global_batch], y[start : start + global_batch])
            optimizer.zero_grad()
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(net.parameters(), clip if clip else float("inf"))
            norms.append(float(norm))
            optimizer.step()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}, norms
