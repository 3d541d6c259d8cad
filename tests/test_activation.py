"""apply_activation_checkpointing: same numbers, activations recomputed, names and keys unchanged."""

from __future__ import annotations

import pytest
import torch

import shardline
from shardline.engine.activation import is_checkpointed
from shardline.errors import PolicyMatchError
from shardline.testing import run_distributed
from tests.models import Block, ParityModel, batch, local_slice, loss_fn


def _train(rank: int, world_size: int, checkpointed: bool) -> tuple[list[float], dict, int]:
    torch.manual_seed(0)
    model = ParityModel()
    keys = list(model.state_dict())
    calls = []
    for block in model.blocks:
        block.fc1.register_forward_hook(lambda *_: calls.append(1))
    if checkpointed:
        names = shardline.apply_activation_checkpointing(model, shardline.layer_policy(Block))
        assert names == ["blocks.0", "blocks.1"]
        assert all(is_checkpointed(b) for b in model.blocks)
    shardline.wrap(model, shardline.layer_policy(Block))
    assert list(model.state_dict()) == keys, "checkpointing changes no parameter name"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(3):
        tokens, targets = batch(step)
        loss = loss_fn(model(local_slice(tokens, rank, world_size)), local_slice(targets, rank, world_size))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():  # no recomputation without grad
        before = len(calls)
        model(tokens)
        assert len(calls) - before == 2
    return losses, shardline.full_state_dict(model), len(calls)


def _compare(rank: int, world_size: int) -> None:
    plain_losses, plain_state, plain_calls = _train(rank, world_size, False)
    ckpt_losses, ckpt_state, ckpt_calls = _train(rank, world_size, True)
    assert ckpt_losses == plain_losses, "recomputation must not change a single bit"
    assert all(torch.equal(ckpt_state[k], plain_state[k]) for k in plain_state)
    # Each block's forward runs twice per training step with checkpointing (forward + recompute).
    assert plain_calls == 3 * 2 + 2
    assert ckpt_calls == 3 * 2 * 2 + 2


def test_checkpointing_is_bitwise_neutral_and_recomputes() -> None:
    run_distributed(_compare, 2)


def test_checkpointing_policy_that_matches_nothing() -> None:
    with pytest.raises(
        PolicyMatchError, match=r"activation checkpointing policy layer_policy\(GRU\) matched no module"
    ):
        shardline.apply_activation_checkpointing(ParityModel(), shardline.layer_policy(torch.nn.GRU))
