"""``shardline._torch_compat``: the installed torch is checked once at import, and every helper works on it.

Part of the compatibility subset (``nox -s compat``): each helper is called here on whichever torch the
session installed, so a release that moves one of these internals fails here by name.
"""

from __future__ import annotations

import runpy
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.torch_version import TorchVersion

from shardline import _torch_compat
from shardline.errors import ConfigurationError
from shardline.testing import run_distributed

pytestmark = pytest.mark.compat


def test_an_older_torch_is_refused_at_import(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "__version__", TorchVersion("2.10.1+cpu"))
    with pytest.raises(ConfigurationError) as info:
        runpy.run_path(_torch_compat.__file__, run_name="shardline_torch_compat_at_import")
    assert str(info.value) == (
        "shardline does not support the installed torch 2.10.1+cpu:\n"
        "  - torch 2.10.1+cpu is older than 2.11\n"
        "shardline supports torch >=2.11: install a release in that range (pip install 'torch>=2.11'), "
        "or a shardline release that supports torch 2.10.1+cpu."
    )


def test_a_missing_private_api_is_named_at_import(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(torch.autograd.profiler, "_is_profiler_enabled")
    monkeypatch.delattr(torch._C, "_current_graph_task_id")
    with pytest.raises(ConfigurationError) as info:
        runpy.run_path(_torch_compat.__file__, run_name="shardline_torch_compat_at_import")
    message = str(info.value)
    assert message.startswith(
        f"shardline does not support the installed torch {torch.__version__}:\n"
        "  - torch._C._current_graph_task_id is missing\n"
        "  - torch.autograd.profiler._is_profiler_enabled is missing\n"
        "shardline supports torch >=2.11"
    ), message


def test_a_missing_save_planner_api_is_named_at_import(monkeypatch: pytest.MonkeyPatch) -> None:
    """shardline's save planner overrides DCP's private global-plan step: without it, the import fails naming it."""
    from torch.distributed.checkpoint import default_planner

    monkeypatch.delattr(default_planner.DefaultSavePlanner, "_create_global_plan")
    monkeypatch.delattr(default_planner, "_validate_global_plan")
    with pytest.raises(ConfigurationError) as info:
        runpy.run_path(_torch_compat.__file__, run_name="shardline_torch_compat_at_import")
    message = str(info.value)
    assert "  - torch.distributed.checkpoint.default_planner._validate_global_plan is missing\n" in message, message
    assert "  - DefaultSavePlanner._create_global_plan is missing\n" in message, message


def test_the_declared_floor_is_the_checked_one() -> None:
    assert _torch_compat.SUPPORTED_TORCH == ">=2.11"
    assert torch.__version__ >= "2.11"  # this process imported shardline: the check passed


def test_autograd_and_profiler_helpers() -> None:
    seen: list[tuple[str, bool]] = []
    x = torch.ones(3, requires_grad=True)

    def hook(grad: torch.Tensor) -> torch.Tensor:
        seen.append(("hook", _torch_compat.in_backward()))
        _torch_compat.queue_backward_callback(lambda: seen.append(("callback", _torch_compat.in_backward())))
        return grad

    y = (x * 2).sum()
    x.register_hook(hook)
    assert not _torch_compat.in_backward()
    y.backward()
    assert seen == [("hook", True), ("callback", True)]  # the callback ran once, at the end of that backward
    assert not _torch_compat.compiled_autograd_active()

    t = torch.zeros(4)
    before = _torch_compat.version_of(t)
    t[1:].add_(1)  # an in-place write through a view
    assert _torch_compat.version_of(t) > before
    assert _torch_compat.storage_key(t[1:]) == _torch_compat.storage_key(t) != _torch_compat.storage_key(t.clone())

    assert not _torch_compat.profiling_enabled()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert _torch_compat.profiling_enabled()


def test_eager_only_runs_eagerly_inside_a_compiled_function() -> None:
    calls: list[bool] = []

    def hook(x: torch.Tensor) -> torch.Tensor:
        calls.append(torch.compiler.is_compiling())
        return x + 1

    eager = _torch_compat.eager_only(hook, reason="a test hook")
    assert eager(torch.zeros(1)).item() == 1.0
    compiled = torch.compile(lambda x: eager(x * 2) * 3, backend="eager")
    assert compiled(torch.ones(1)).item() == 9.0
    assert calls == [False, False]  # never traced: dynamo left it to run as plain Python


def test_fake_tensors_carry_shapes_without_data() -> None:
    from torch._subclasses.fake_tensor import FakeTensor

    with _torch_compat.fake_tensor_mode():
        t = torch.empty(1 << 30, dtype=torch.float32)  # 4 GiB, never allocated
    assert isinstance(t, FakeTensor)
    assert t.shape == (1 << 30,)


def test_checkpoint_helpers(tmp_path: Path) -> None:
    writer = FileSystemWriter(str(tmp_path))
    marker = object()
    _torch_compat.set_writer_filesystem(writer, marker)
    assert writer.fs is marker
    assert _torch_compat.fsspec_storage(reader=True).__name__ == "FsspecReader"
    assert _torch_compat.fsspec_storage(reader=False).__name__ == "FsspecWriter"
    config = _torch_compat.elastic_launch_config(
        min_nodes=1, max_nodes=1, nproc_per_node=2, run_id="x", shutdown_timeout=5.0, not_a_field=1
    )
    assert (config.nproc_per_node, config.run_id) == (2, "x")


def test_pickle_allowlists_match_what_this_torch_writes() -> None:
    # The globals a plain tensor's torch.save pickle names are each given a role.
    import io
    import zipfile

    buffer = io.BytesIO()
    torch.save(torch.arange(4.0), buffer)
    with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as archive:
        data = archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))
    import pickletools

    named = [arg.split(" ") for op, arg, _ in pickletools.genops(data) if op.name == "GLOBAL"]
    named += _stack_globals(data)
    assert named, "torch.save's pickle names no globals?"
    for module, name in named:
        assert _torch_compat.tensor_pickle_global(module, name) is not None, (module, name)
    assert _torch_compat.typed_storage_dtype("FloatStorage") is torch.float32
    assert _torch_compat.typed_storage_dtype("Size") is None
    assert _torch_compat.is_dcp_metadata_global("torch.distributed.checkpoint.metadata", "Metadata")
    assert _torch_compat.is_dcp_metadata_global("torch", "bfloat16")
    assert not _torch_compat.is_dcp_metadata_global("os", "system")


def _stack_globals(data: bytes) -> list[list[str]]:
    """``STACK_GLOBAL`` names (protocol 4+): the two strings pushed before each."""
    import pickletools

    strings: list[str] = []
    out = []
    for op, arg, _ in pickletools.genops(data):
        if isinstance(arg, str) and "UNICODE" in op.name:
            strings.append(arg)
        if op.name == "STACK_GLOBAL":
            out.append(strings[-2:])
    return out


def _collectives(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    group = dist.group.WORLD
    gathered = torch.empty(2 * world_size)
    _torch_compat.all_gather_into(gathered, torch.full((2,), float(rank)), group)
    reduced = torch.empty(2)
    _torch_compat.reduce_scatter_into(reduced, torch.arange(2.0 * world_size) + rank, group)
    mesh = init_device_mesh("cpu", (world_size,))
    dtensor = DTensor.from_local(torch.full((2,), float(rank)), mesh, [Shard(0)])
    host = torch.full((2,), 10.0 + rank)
    swapped = _torch_compat.dtensor_with_local(dtensor, local=host)
    uneven = DTensor.from_local(torch.zeros(3 + rank, 4, dtype=torch.float16), mesh, [Shard(0)], run_check=False)
    to_local, DTensor.to_local = DTensor.to_local, None  # a save sums thousands: no autograd node per tensor
    try:
        local_bytes = _torch_compat.dtensor_local_bytes(uneven)
    finally:
        DTensor.to_local = to_local
    return {
        "local_bytes": local_bytes,
        "gathered": gathered.tolist(),
        "reduced": reduced.tolist(),
        "timeout": _torch_compat.group_timeout(None),
        "same_spec": swapped.placements == dtensor.placements and swapped.shape == dtensor.shape,
        "local_is_host": swapped.to_local().data_ptr() == host.data_ptr(),
    }


def test_collectives_timeout_and_dtensor_helpers() -> None:
    results = run_distributed(_collectives, 2, timeout=60)
    for rank, res in enumerate(results):
        assert res["gathered"] == [0.0, 0.0, 1.0, 1.0]
        assert res["reduced"] == [2 * (2.0 * rank) + 1, 2 * (2.0 * rank + 1) + 1]  # (i + 0) + (i + 1)
        assert isinstance(res["timeout"], timedelta)
        assert res["same_spec"]
        assert res["local_is_host"]
        assert res["local_bytes"] == (3 + rank) * 4 * 2
