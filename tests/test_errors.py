"""Every misuse gets a specific error that says what was wrong and how to fix it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import shardline
from shardline.errors import (
    ConfigurationError,
    DistributedNotInitializedError,
    PolicyMatchError,
    ShardingError,
)
from shardline.testing import run_distributed
from tests.models import Block, ParityModel


def test_no_process_group() -> None:
    assert not dist.is_initialized()
    with pytest.raises(DistributedNotInitializedError, match=r"init_process_group\(\)"):
        shardline.fully_shard(nn.Linear(2, 2))


def test_unknown_strategy_suggests_the_closest() -> None:
    with pytest.raises(
        ConfigurationError, match=r"unknown sharding strategy 'fulll_shard'\. Did you mean 'full_shard'"
    ):
        shardline.ShardingStrategy.parse("fulll_shard")
    with pytest.raises(ConfigurationError, match=r"no_shard \(ddp, zero0\), shard_opt \(zero1\)"):
        shardline.ShardingStrategy.parse("zero4")


def test_mixed_precision_rejects_non_float_dtypes() -> None:
    with pytest.raises(ConfigurationError, match=r"MixedPrecision.param_dtype must be a floating-point"):
        shardline.MixedPrecision(param_dtype=torch.int32)


def test_layer_policy_paths() -> None:
    assert shardline.layer_policy("tests.models.Block").classes == (Block,)
    with pytest.raises(ConfigurationError, match=r"module 'tests.models' has no attribute 'Blok'.*Block"):
        shardline.layer_policy("tests.models.Blok")
    with pytest.raises(ConfigurationError, match=r"cannot import module 'no_such_package.layers'"):
        shardline.layer_policy("no_such_package.layers.Block")
    with pytest.raises(ConfigurationError, match="expected a dotted class path"):
        shardline.layer_policy("Block")
    with pytest.raises(ConfigurationError, match=r"nn\.Module subclasses"):
        shardline.layer_policy(int)


class TiedAcross(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.blocks[1].fc1.weight = self.blocks[0].fc1.weight


class IntegerParam(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.count = nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False)


def _misuse(rank: int, world_size: int) -> None:
    model = shardline.fully_shard(nn.Linear(4, 4))
    with pytest.raises(ShardingError, match=r"this Linear is already sharded.*once per module"):
        shardline.fully_shard(model)

    root = ParityModel()
    shardline.fully_shard(root)
    with pytest.raises(
        ShardingError,
        match=r"'gate' of the Block being sharded is already managed by the unit at 'ParityModel' \(as 'blocks.0.gate'\).*bottom-up",
    ):
        shardline.fully_shard(root.blocks[0])

    with pytest.raises(ShardingError, match=r"'fc1.weight' .* shared with parameter 'fc1.weight' of 'blocks.0'"):
        shardline.wrap(TiedAcross(), shardline.layer_policy(Block))

    with pytest.raises(
        PolicyMatchError, match=r"matched no module of ParityModel.*Block, Embedding, LayerNorm, Linear"
    ):
        shardline.wrap(ParityModel(), shardline.layer_policy(nn.Conv2d))

    with pytest.raises(ShardingError, match=r"parameter 'count' has dtype torch.int64; only floating-point"):
        shardline.fully_shard(IntegerParam())

    half_meta = nn.Linear(3, 3)
    half_meta.bias = nn.Parameter(torch.empty(3, device="meta"))
    with pytest.raises(ShardingError, match=r"one device, but 'weight' is on cpu and 'bias' is on meta"):
        shardline.fully_shard(half_meta)

    with pytest.raises(ConfigurationError, match="reshard_after_forward must be True, False, None or a positive int"):
        shardline.fully_shard(nn.Linear(2, 2), reshard_after_forward=1.5)
    with pytest.raises(
        ConfigurationError, match=r"reshard_after_forward=3 must divide the shard group's size 2.*\[1, 2\]"
    ):
        shardline.fully_shard(nn.Linear(2, 2), reshard_after_forward=3)
    with pytest.raises(ConfigurationError, match=r"strategy no_shard does not shard parameters"):
        shardline.fully_shard(nn.Linear(2, 2), strategy="ddp", reshard_after_forward=2)
    with pytest.raises(ConfigurationError, match=r"mixed_precision must be a shardline\.MixedPrecision"):
        shardline.fully_shard(nn.Linear(2, 2), mixed_precision=torch.bfloat16)
    with pytest.raises(ConfigurationError, match=r"mesh must be a torch\.distributed ProcessGroup"):
        shardline.fully_shard(nn.Linear(2, 2), mesh="world")

    mesh2d = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("replicate", "shard"))
    with pytest.raises(
        ConfigurationError, match=r"full_shard shards over one mesh dimension, but got a 2-D mesh of shape \(1, 2\)"
    ):
        shardline.fully_shard(nn.Linear(2, 2), mesh=mesh2d)
    shardline.fully_shard(nn.Linear(2, 2), mesh=mesh2d["shard"])  # a 1-D slice is fine
    with pytest.raises(ConfigurationError, match=r"hybrid_shard .* needs a 2-D DeviceMesh .*got no mesh.*hybrid_mesh"):
        shardline.fully_shard(nn.Linear(2, 2), strategy="hsdp")
    with pytest.raises(ConfigurationError, match=r"needs a 2-D DeviceMesh .*got a 1-D DeviceMesh of shape \(2,\)"):
        shardline.fully_shard(nn.Linear(2, 2), strategy="hybrid_shard_zero2", mesh=mesh2d["shard"])
    shardline.fully_shard(nn.Linear(2, 2), strategy="hybrid_shard", mesh=mesh2d)

    # The group's device map decides which devices a unit may live on (tests/test_device.py: every case).
    unit = shardline.fully_shard(nn.Linear(2, 2)).shard_unit
    with pytest.raises(ConfigurationError, match=r"parameter 'w' is on xpu:0, but the process group's backend 'gloo'"):
        unit.mesh.check_device(torch.device("xpu", 0), "parameter 'w'")

    # A shard replaced behind the engine's back is caught at the next gather.
    model = shardline.fully_shard(nn.Linear(4, 4))
    model.weight.data = torch.zeros(5, 5)
    with pytest.raises(
        ShardingError, match=r"shard of parameter 'weight' .* was replaced .* before calling fully_shard"
    ):
        model(torch.ones(1, 4))


def test_misuse_errors() -> None:
    run_distributed(_misuse, 2)


def _not_a_member(rank: int, world_size: int) -> None:
    pair = dist.new_group([0, 1])
    if rank == 2:
        with pytest.raises(
            ConfigurationError, match=r"global rank 2\) is not a member of the process group passed as mesh"
        ):
            shardline.fully_shard(nn.Linear(2, 2), mesh=pair)
    else:
        shardline.fully_shard(nn.Linear(2, 2), mesh=pair)

    # clip_grad_norm_ refuses units that average over different ranks.
    if rank < 2:
        model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        shardline.fully_shard(model[0], mesh=pair)
        shardline.fully_shard(model)
        with pytest.raises(ConfigurationError, match="same data-parallel ranks"):
            model.clip_grad_norm_(1.0)


def test_mesh_membership_and_groups() -> None:
    run_distributed(_not_a_member, 3)


def test_error_chain_walks_causes_contexts_and_dcp_rank_failures() -> None:
    from torch.distributed.checkpoint.api import CheckpointException

    from shardline.errors import error_chain

    disk = OSError(28, "No space left on device")
    rank1 = RuntimeError("rank 1 failed")
    dcp_error = CheckpointException("save failed", {0: (disk, None), 1: (rank1, None)})
    try:
        try:
            raise dcp_error
        except CheckpointException as exc:
            raise ValueError("wrapped") from exc
    except ValueError as outer:
        top = outer
    walked = list(error_chain(top))
    assert walked[0] is top
    assert {id(e) for e in walked} == {id(top), id(dcp_error), id(disk), id(rank1)}
    assert len(walked) == 4, "each exception once, even when it is both cause and context"
