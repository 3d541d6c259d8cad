"""Meta-device construction + sharding + materialize == CPU construction, bit for bit, one full tensor at a time."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardline
from shardline.errors import ShardingError
from shardline.testing import RankFailedError, run_distributed
from tests.models import Block, ParityModel


def _spy_init(log: list[int]):
    def init(module: nn.Module) -> None:
        log.append(sum(not p.is_meta for p in module._parameters.values() if p is not None))
        module.reset_parameters()

    return init


def _materialize(rank: int, world_size: int, strategy: str) -> dict:
    torch.manual_seed(1234)
    reference = ParityModel(n_blocks=3)

    with torch.device("meta"):
        model = ParityModel(n_blocks=3)
    shardline.wrap(model, shardline.layer_policy(Block), strategy=strategy)
    opt = torch.optim.AdamW(model.parameters())  # created before materialize on purpose
    assert all(p.is_meta for p in model.parameters())
    log: list[int] = []
    torch.manual_seed(1234)
    shardline.materialize(model, init_fn=_spy_init(log))
    assert not any(p.is_meta for p in model.parameters())
    assert all(b.device.type == "cpu" for b in model.buffers())
    # The optimizer still holds the live parameters.
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in model.parameters()}

    full = shardline.full_state_dict(model)
    expected = reference.state_dict()
    mismatched = [k for k in expected if not torch.equal(full[k], expected[k])]
    # The default path (reset_parameters) gives the same result as the spy.
    with torch.device("meta"):
        again = ParityModel(n_blocks=3)
    shardline.wrap(again, shardline.layer_policy(Block), strategy=strategy)
    torch.manual_seed(1234)
    shardline.materialize(again)
    same = all(torch.equal(a, b) for a, b in zip(shardline.full_state_dict(again).values(), full.values(), strict=True))
    return {"mismatched": mismatched, "max_real_params": max(log), "same_default": same}


def _grid(rank: int, world_size: int) -> dict:
    return {s: _materialize(rank, world_size, s) for s in ("full_shard", "no_shard")}


@pytest.mark.parametrize("world_size", [2, 3])
def test_materialize_equals_cpu_init_bitwise(world_size: int) -> None:
    for strategy, res in run_distributed(_grid, world_size)[0].items():
        assert res["mismatched"] == [], f"{strategy}: differs from CPU init: {res['mismatched']}"
        assert res["max_real_params"] == 1, "a module's initializer saw more than one full parameter at once"
        assert res["same_default"]


class NoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))


class ComputedBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("table", torch.arange(4.0))


def _errors(rank: int, world_size: int) -> None:
    with torch.device("meta"):
        model = nn.Sequential(NoReset(), nn.Linear(4, 4))
    shardline.fully_shard(model)
    with pytest.raises(ShardingError, match=r"NoReset have meta parameters but no reset_parameters\(\)"):
        shardline.materialize(model)
    # init_fn fixes it.
    shardline.materialize(
        model, init_fn=lambda m: nn.init.zeros_(m.w) if isinstance(m, NoReset) else m.reset_parameters()
    )
    assert torch.count_nonzero(model[0].w) == 0

    with torch.device("meta"):
        model = ComputedBuffer()
    shardline.fully_shard(model)
    with pytest.raises(ShardingError, match="buffer 'table' of ComputedBuffer was not initialized"):
        shardline.materialize(model)


def test_materialize_errors_name_the_module() -> None:
    run_distributed(_errors, 2)


def test_materialize_without_process_group_needs_none_for_plain_models() -> None:
    with torch.device("meta"):
        model = nn.Linear(3, 2)
    torch.manual_seed(5)
    shardline.materialize(model)
    torch.manual_seed(5)
    assert torch.equal(model.weight, nn.Linear(3, 2).weight)


def _rank_error(rank: int, world_size: int) -> None:
    raise RuntimeError("boom")


def test_harness_error_is_visible() -> None:  # guards the helper the tests above rely on
    with pytest.raises(RankFailedError, match="boom"):
        run_distributed(_rank_error, 2)
