"""unshard()/reshard(), sync_module_states, and shards exposed as DTensor pieces without copies."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard

import shardline
from shardline.errors import ShardingError
from shardline.testing import run_distributed
from tests.models import Block, ParityModel


def _unshard_reshard(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = shardline.wrap(ParityModel(), shardline.layer_policy(Block))
    block = model.blocks[0]
    assert block.fc1.weight.shape[0] < 7
    with shardline.count_collectives(model) as counter:
        block.unshard()
    assert block.fc1.weight.shape == (7, 10)
    assert counter.count("all_gather", unit="blocks.0") == 1
    with shardline.count_collectives(model) as counter:
        model(torch.zeros(2, 3, dtype=torch.long)).sum().backward()
    assert counter.count("all_gather", unit="blocks.0") == 0, "an explicitly gathered unit is not gathered again"
    assert block.fc1.weight.shape == (7, 10), "it stays gathered until reshard()"
    block.reshard()
    assert block.fc1.weight.shape[0] < 7
    assert block.fc1.weight is next(sp.sharded for sp in block.shard_unit.params if sp.fqn == "fc1.weight")


def test_unshard_and_reshard() -> None:
    run_distributed(_unshard_reshard, 2)


def _sync_states(rank: int, world_size: int) -> None:
    torch.manual_seed(rank)  # every rank initializes differently
    model = ParityModel()
    model.pos_scale.fill_(float(rank))
    shardline.wrap(model, shardline.layer_policy(Block), sync_module_states=True)
    torch.manual_seed(0)
    expected = ParityModel().state_dict()
    full = shardline.full_state_dict(model)
    assert all(torch.equal(full[k], expected[k]) for k in expected if k != "pos_scale")
    assert torch.equal(full["pos_scale"], torch.zeros(10)), "buffers come from rank 0 too"
    assert shardline.comm_stats(model).count("broadcast") == 3, "one broadcast per unit (one dtype each)"

    with torch.device("meta"):
        meta = nn.Linear(2, 2)
    with pytest.raises(ShardingError, match="sync_module_states=True needs materialized parameters"):
        shardline.fully_shard(meta, sync_module_states=True)


def test_sync_module_states_broadcasts_rank0() -> None:
    run_distributed(_sync_states, 3)


def _dtensor_pieces(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    expected = ParityModel().state_dict()
    torch.manual_seed(0)
    model = shardline.wrap(ParityModel(), shardline.layer_policy(Block), root_kwargs={"strategy": "no_shard"})
    for unit in shardline.engine.subtree_units(model):
        prefix = f"{unit.name}." if unit.name else ""
        for sp in unit.params:
            dt = unit.to_dtensor(sp)
            assert dt.to_local().data_ptr() == sp.sharded.data_ptr(), "no copy"
            assert dt.placements == ((Replicate(),) if unit.name == "" else (Shard(0),))
            assert torch.equal(dt.full_tensor(), expected[prefix + sp.fqn]), sp.fqn


def test_shards_are_dtensor_pieces_without_copy() -> None:
    run_distributed(_dtensor_pieces, 3)
