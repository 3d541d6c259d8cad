"""Rank functions of the adoption tests: a checkpoint written by plain ``dcp.save`` from torch's own FSDP2."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.fsdp import fully_shard


def tiny(seed: int = 0) -> nn.Module:
    """The model every adoption test saves and loads: two linear layers."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def trained(model: nn.Module) -> torch.optim.Optimizer:
    """One Adam step on a fixed batch, so the optimizer holds state."""
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    torch.manual_seed(1)
    model(torch.randn(4, 8)).pow(2).mean().backward()
    optimizer.step()
    return optimizer


def save_fsdp2(rank: int, world: int, path: str) -> None:
    """FSDP2 at ``world`` ranks, one step, then ``dcp.save`` of torch's FQN-keyed state dicts (no shardline)."""
    model = tiny()
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    optimizer = trained(model)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.save(state, checkpoint_id=path)
