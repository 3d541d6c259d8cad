"""The device comes from the model, not from the backend's name; the harness selects each rank's GPU for NCCL.

The selection logic is pure (``shardline.engine.device``), so CUDA inputs are tested here without a
GPU; every backend string torch accepts on a CPU machine is then run end to end.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardline
from shardline.engine import subtree_units
from shardline.engine.device import backend_device_map, default_device_type, resolve_device
from shardline.errors import ConfigurationError, ShardingError
from shardline.testing import rank_device, run_distributed

CPU, CUDA0, CUDA1, META = (torch.device(d) for d in ("cpu", "cuda:0", "cuda:1", "meta"))
NCCL_MAP = {"cpu": "gloo", "cuda": "nccl"}  # what get_backend_config says for init_process_group() on a GPU machine


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ("gloo", {"cpu": "gloo", "cuda": "gloo"}),
        ("GLOO", {"cpu": "gloo", "cuda": "gloo"}),
        ("nccl", {"cuda": "nccl"}),
        ("cpu:gloo", {"cpu": "gloo"}),
        ("cpu:gloo,cuda:nccl", NCCL_MAP),
        ("cuda:gloo", {"cuda": "gloo"}),
        ("undefined", {}),  # no device map in the name: get_backend_config has it
        ("mpi", {}),
    ],
)
def test_backend_strings_map_device_types(config: str, expected: dict) -> None:
    assert backend_device_map(config) == expected


def _resolve(**kwargs: object) -> torch.device:
    kwargs.setdefault("backend", "undefined")
    kwargs.setdefault("device_map", NCCL_MAP)
    return resolve_device(**kwargs)  # type: ignore[arg-type]


def test_device_is_the_parameters_for_cuda_inputs() -> None:
    # A CUDA model on torch's default group (no backend given) or "cpu:gloo,cuda:nccl": CUDA, not CPU.
    assert _resolve(params=[("w", CUDA1), ("b", CUDA1)], cuda_available=True, current_cuda=0) == CUDA1
    # A root without parameters takes the device of the units below it, not the CPU.
    assert _resolve(params=[], sub_units=[("blocks.0", CUDA1), ("blocks.1", CUDA1)], cuda_available=True) == CUDA1
    # ... or of its buffers; with nothing at all, the current CUDA device when NCCL serves CUDA.
    assert _resolve(params=[], buffers=[("rope", CUDA0)], cuda_available=True) == CUDA0
    assert _resolve(params=[], cuda_available=True, current_cuda=1) == CUDA1
    assert _resolve(params=[], cuda_available=False) == CPU
    # gloo serves CUDA tensors too, but a module with nothing on a device stays on the CPU there.
    assert _resolve(params=[], device_map=backend_device_map("gloo"), cuda_available=True) == CPU
    # An explicit device: for a unit without parameters, and it must agree with the parameters.
    assert _resolve(params=[], explicit=torch.device("cuda", 1)) == CUDA1
    assert _resolve(params=[("w", CUDA0)], explicit=CUDA0) == CUDA0
    assert _resolve(params=[("w", META)], explicit=CUDA0) == META  # materialize() places it later
    assert _resolve(params=[], explicit=torch.device("cuda"), current_cuda=1) == CUDA1  # index filled in
    assert _resolve(params=[("w", CUDA0)], device_map={}) == CUDA0  # a backend we do not know: accepted
    assert default_device_type(NCCL_MAP, cuda_available=True) == "cuda"
    assert default_device_type({"cpu": "gloo"}, cuda_available=True) == "cpu"


def test_device_mismatches_name_both_sides() -> None:
    with pytest.raises(ShardingError, match=r"'w' is on cuda:0 and 'b' is on cpu"):
        _resolve(params=[("w", CUDA0), ("b", CPU)])
    with pytest.raises(ShardingError, match=r"'w' is on cuda:0 and 'b' is on cuda:1"):
        _resolve(params=[("w", CUDA0), ("b", CUDA1)])
    # A CUDA model on a CPU-only group.
    with pytest.raises(
        ConfigurationError,
        match=r"parameter 'w' is on cuda:0, but the process group's backend 'cpu:gloo' communicates only cpu "
        r"tensors with gloo\. Move the model to cpu .*backend='nccl'",
    ):
        _resolve(params=[("w", CUDA0)], device_map=backend_device_map("cpu:gloo"), backend="cpu:gloo")
    # A CPU model on a CUDA-only group.
    with pytest.raises(ConfigurationError, match=r"parameter 'w' is on cpu, but .*'nccl' communicates only cuda"):
        _resolve(params=[("w", CPU)], device_map=backend_device_map("nccl"), backend="nccl")
    with pytest.raises(ConfigurationError, match=r"unit 'blocks.0' below this module is on cuda:0, .*'cpu:gloo'"):
        _resolve(params=[], sub_units=[("blocks.0", CUDA0)], device_map={"cpu": "gloo"}, backend="cpu:gloo")
    with pytest.raises(ConfigurationError, match=r"fully_shard\(device=cpu\) but parameter 'w' is on cuda:0"):
        _resolve(params=[("w", CUDA0)], explicit=CPU)
    with pytest.raises(ConfigurationError, match=r"'blocks.0' on cuda:0 and 'blocks.1' on cuda:1"):
        _resolve(params=[], sub_units=[("blocks.0", CUDA0), ("blocks.1", CUDA1)])


def test_harness_selects_each_ranks_gpu_for_nccl() -> None:
    for backend in ("nccl", "cpu:gloo,cuda:nccl", "NCCL", None):
        assert rank_device(backend, local_rank=1, cuda_available=True, device_count=2) == CUDA1
    for backend in ("gloo", "cpu:gloo", "cuda:gloo"):
        assert rank_device(backend, local_rank=1, cuda_available=True, device_count=2) is None
    assert rank_device(None, local_rank=0, cuda_available=False, device_count=0) is None  # torch's default on CPU
    with pytest.raises(ConfigurationError, match=r"local rank 1 has none \(CUDA available: True, 1 devices\)"):
        rank_device("nccl", local_rank=1, cuda_available=True, device_count=1)
    if not torch.cuda.is_available():  # refused before any rank starts, naming why
        with pytest.raises(ConfigurationError, match=r"'nccl' runs CUDA collectives on NCCL, which needs one GPU"):
            run_distributed(_train_on_cpu, 1, backend="nccl")


def _train_on_cpu(rank: int, world_size: int) -> dict:
    """A model whose root owns no parameters, sharded on whatever group the harness made; one step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))
    shardline.wrap(model, lambda m: isinstance(m, nn.Linear))
    hybrid = shardline.fully_shard(nn.Linear(4, 2), strategy="hsdp", mesh=shardline.hybrid_mesh(shard_size=world_size))
    model(torch.randn(3, 4)).sum().backward()
    with shardline.count_collectives(model) as counter:
        norm = model.clip_grad_norm_(1.0)
    hybrid(torch.randn(3, 4)).sum().backward()
    explicit = shardline.fully_shard(nn.Linear(2, 2), device="cpu").shard_unit.device
    with pytest.raises(ConfigurationError, match=r"fully_shard\(device=meta\) but parameter 'weight' is on cpu"):
        shardline.fully_shard(nn.Linear(2, 2), device="meta")
    return {
        "explicit": str(explicit),
        "backend": str(dist.get_backend()),
        "devices": {str(u.device) for u in subtree_units(model) + subtree_units(hybrid)},
        "norm_device": str(norm.device),
        "clip": [(r.kind.value, r.bytes) for r in counter.records],
        "dtensor_devices": {v.device_mesh.device_type for v in hybrid.state_dict().values()},
    }


def _refused(rank: int, world_size: int) -> str:
    with pytest.raises(ConfigurationError) as error:
        shardline.fully_shard(nn.Linear(2, 2))
    return str(error.value)


@pytest.mark.parametrize("backend", [None, "gloo", "GLOO", "cpu:gloo", "cpu:gloo,cuda:gloo"])
def test_every_cpu_backend_string_shards_a_cpu_model(backend: str | None) -> None:
    for res in run_distributed(_train_on_cpu, 2, backend=backend, timeout=60):
        assert res["devices"] == {"cpu"}, res  # the root without parameters too
        assert res["norm_device"] == "cpu"
        assert res["clip"] == [("all_reduce", 4)]  # one fp32 scalar over the group
        assert res["dtensor_devices"] == {"cpu"}
        assert res["explicit"] == "cpu"
    if backend is None:
        assert res["backend"] == "undefined"  # what torch registers: the device map decides, not the name


def test_a_cpu_model_on_a_cuda_only_group_is_refused() -> None:
    (message,) = run_distributed(_refused, 1, backend="cuda:gloo", timeout=60)
    assert "parameter 'weight' is on cpu, but the process group's backend 'cuda:gloo' communicates only cuda" in message
