"""Full state dicts: gathered keys/values equal the unsharded model's; loading scatters them back."""

from __future__ import annotations

import pytest
import torch

import shardline
from shardline.errors import StateDictError
from shardline.testing import run_distributed
from tests.models import Block, ParityModel, batch, local_slice, loss_fn
from tests.numerics import close_ratio

pytestmark = pytest.mark.numerics  # run again under another CPU kernel set by .ci/run


def _make(strategy: str) -> torch.nn.Module:
    return shardline.wrap(ParityModel(), shardline.layer_policy(Block), strategy=strategy)


def _round_trip(rank: int, world_size: int, strategy: str) -> dict:
    torch.manual_seed(0)
    reference = ParityModel()
    torch.manual_seed(0)
    model = _make(strategy)
    expected = reference.state_dict()

    with shardline.count_collectives(model) as counter:
        full = shardline.full_state_dict(model)
    gathers = [r.unit for r in counter.records if r.kind.value == "all_gather"]
    assert list(full) == list(expected), "keys and order must equal the unsharded model's state_dict()"
    assert all(torch.equal(full[k], expected[k]) for k in expected)
    assert full["emb.weight"] is full["head.weight"], "tied parameters map to one tensor"
    assert all(t.device.type == "cpu" and not t.requires_grad for t in full.values())

    only0 = shardline.full_state_dict(model, rank0_only=True)
    assert (list(only0) == list(expected)) if rank == 0 else only0 == {}

    # Train a step so the model differs, then load the reference back: every rank passes the full dict.
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    tokens, targets = batch(0)
    loss_fn(model(local_slice(tokens, rank, world_size)), local_slice(targets, rank, world_size)).backward()
    opt.step()
    assert not torch.equal(shardline.full_state_dict(model)["blocks.0.fc1.weight"], expected["blocks.0.fc1.weight"])
    with shardline.count_collectives(model) as load_counter:
        shardline.load_full_state_dict(model, expected)
    assert load_counter.records == [], "loading a full state dict on every rank needs no communication"
    back = shardline.full_state_dict(model)
    assert all(torch.equal(back[k], expected[k]) for k in expected)

    # The model still trains after loading, and equals the reference doing the same.
    ref_loss = loss_fn(reference(tokens), targets).item()
    loss = loss_fn(model(local_slice(tokens, rank, world_size)), local_slice(targets, rank, world_size))
    total = loss.detach().clone()
    torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.AVG)
    assert close_ratio(total.item(), ref_loss) <= 1, (total.item(), ref_loss)  # assert_close's fp32 defaults

    # Only rank 0 holds the dict: it is scattered unit by unit.
    scrambled = {k: torch.randn_like(v) if v.is_floating_point() else v for k, v in expected.items()}
    shardline.load_full_state_dict(model, scrambled)
    with shardline.count_collectives(model) as bcast_counter:
        shardline.load_full_state_dict(model, expected if rank == 0 else None, broadcast_from_rank0=True)
    back = shardline.full_state_dict(model)
    assert all(torch.equal(back[k], expected[k]) for k in expected)
    kinds = sorted({r.kind.value for r in bcast_counter.records})
    return {"gathers": gathers, "load_kinds": kinds}


def _grid(rank: int, world_size: int) -> dict:
    return {s: _round_trip(rank, world_size, s) for s in ("full_shard", "no_shard")}


@pytest.mark.parametrize("world_size", [2, 3])
def test_full_state_dict_round_trip(world_size: int) -> None:
    res = run_distributed(_grid, world_size)[0]
    assert res["full_shard"]["gathers"] == ["<root>", "blocks.0", "blocks.1"], "one all-gather per unit"
    assert res["full_shard"]["load_kinds"] == ["broadcast", "scatter"]
    assert res["no_shard"]["gathers"] == []
    assert res["no_shard"]["load_kinds"] == ["broadcast"]


def _bad_dicts(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = _make("full_shard")
    good = shardline.full_state_dict(model)
    before = shardline.full_state_dict(model)

    missing = {k: v for k, v in good.items() if k != "blocks.1.fc2.bias"}
    with pytest.raises(StateDictError, match=r"missing 1 key\(s\): blocks.1.fc2.bias"):
        shardline.load_full_state_dict(model, missing)
    shardline.load_full_state_dict(model, missing, strict=False)  # allowed when every rank has the dict

    extra = {**good, "blocks.9.fc1.weight": torch.zeros(1)}
    with pytest.raises(StateDictError, match=r"unexpected 1 key\(s\): blocks.9.fc1.weight"):
        shardline.load_full_state_dict(model, extra)

    wrong = {**good, "blocks.0.fc1.weight": torch.zeros(8, 10)}
    with pytest.raises(StateDictError, match=r"blocks.0.fc1.weight: checkpoint \(8, 10\) vs model \(7, 10\)"):
        shardline.load_full_state_dict(model, wrong, strict=False)

    # Rank 0 validates and every rank raises the same error, before anything is written.
    with pytest.raises(StateDictError, match=r"missing 1 key\(s\): blocks.1.fc2.bias"):
        shardline.load_full_state_dict(model, missing if rank == 0 else None, broadcast_from_rank0=True, strict=False)
    after = shardline.full_state_dict(model)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_bad_state_dicts_are_rejected_on_every_rank() -> None:
    run_distributed(_bad_dicts, 2)
