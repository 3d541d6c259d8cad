"""Which device a unit lives on, and whether its process group can communicate it.

Note: the device comes from the model, not from the backend's name. A process group does not
name one device: ``init_process_group()`` without a backend registers ``"undefined"`` (gloo for
CPU tensors, NCCL for CUDA ones), ``"cpu:gloo,cuda:nccl"`` names both, and gloo itself moves
CUDA tensors too. What a group *can* communicate is read from ``dist.get_backend_config(group)``
(``"cpu:gloo,cuda:nccl"``: device type -> backend), and what a unit *does* communicate is the
device its parameters are on:

1. the parameters' device (they must share one), or ``device=`` when given (it must agree with
   them);
2. a unit without parameters (a root over sharded blocks) takes its sub-units' device, else its
   buffers' device;
3. a module with neither: the current CUDA device when the group communicates CUDA tensors
   through a CUDA backend (NCCL) and CUDA is available, else the CPU.

The result must be a device type the group communicates; otherwise one error names both (a
CUDA model on a CPU-only group). Everything here but :func:`group_device_types` is pure logic
over its arguments, so it is tested for CUDA inputs on a machine without a GPU.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from shardline.errors import ConfigurationError, ShardingError

__all__ = ["backend_device_map", "default_device_type", "group_device_map", "resolve_device"]

# Backends named without a device type, and the device types torch registers them for.
_PLAIN_BACKENDS: dict[str, tuple[str, ...]] = {"gloo": ("cpu", "cuda"), "nccl": ("cuda",), "xccl": ("xpu",)}


def backend_device_map(config: str) -> dict[str, str]:
    """``{device type: backend}`` from a backend string or config (``"cpu:gloo,cuda:nccl"``, ``"gloo"``).

    Empty when the string names a backend shardline does not know (then any device is accepted).
    """
    devices: dict[str, str] = {}
    for part in str(config).lower().split(","):
        part = part.strip()
        if not part:
            continue
        if ":" in part:
            device, _, backend = part.partition(":")
            devices[device.strip()] = backend.strip()
        elif part in _PLAIN_BACKENDS:
            for device in _PLAIN_BACKENDS[part]:
                devices.setdefault(device, part)
        else:  # "undefined", "mpi", a custom backend: do not guess
            return {}
    return devices


def group_device_map(group: dist.ProcessGroup) -> dict[str, str]:
    """``{device type: backend}`` the process group communicates (see the module note)."""
    try:
        config = dist.get_backend_config(group)
    except (RuntimeError, ValueError, AttributeError):  # a backend without a device map
        config = str(dist.get_backend(group))
    return backend_device_map(config)


def default_device_type(device_map: Mapping[str, str], *, cuda_available: bool) -> str:
    """The device type of a module with nothing on a device: CUDA when a CUDA backend (not gloo) serves it."""
    if cuda_available and device_map.get("cuda", "gloo") != "gloo":
        return "cuda"
    return "cpu"


def resolve_device(
    *,
    params: Sequence[tuple[str, torch.device]],
    device_map: Mapping[str, str],
    backend: str,
    explicit: torch.device | None = None,
    sub_units: Sequence[tuple[str, torch.device]] = (),
    buffers: Sequence[tuple[str, torch.device]] = (),
    cuda_available: bool = False,
    current_cuda: int = 0,
) -> torch.device:
    """The device of a unit, following the module note's order; raises when it cannot be communicated.

    Args:
        params: ``(name, device)`` of the unit's own parameters.
        device_map: What the group communicates, from :func:`group_device_map`; empty: anything.
        backend: The group's backend string, for messages.
        explicit: ``device=`` passed to ``fully_shard``.
        sub_units: ``(name, device)`` of the units below, for a unit without parameters.
        buffers: ``(name, device)`` of the module's buffers, for a module with neither.
        cuda_available: Whether CUDA is available in this process.
        current_cuda: The current CUDA device index.

    Raises:
        ShardingError: The parameters are on two devices.
        ConfigurationError: ``explicit`` disagrees with the parameters or the units below, the units
            below are on two devices, or the group cannot communicate the device.
    """
    if params:
        name0, first = params[0]
        for name, device in params[1:]:
            if device != first:
                raise ShardingError(
                    f"parameters of one unit must be on one device, but '{name0}' is on {first} and '{name}' is on "
                    f"{device}. Move the module with module.to(device) before fully_shard."
                )
        device = first
        if explicit is not None and device.type != "meta" and device != explicit:
            raise ConfigurationError(
                f"fully_shard(device={explicit}) but parameter '{name0}' is on {device}. Move the module there "
                f"first (module.to('{explicit}')) or leave device= out: the parameters' device is used."
            )
    elif explicit is not None:
        device = explicit
    elif sub_units:
        name0, device = sub_units[0]
        for name, other in sub_units[1:]:
            if other != device and "meta" not in (other.type, device.type):
                raise ConfigurationError(
                    f"the units under this module are on two devices: {name0!r} on {device} and {name!r} on {other}. "
                    "Move the whole model to one device before sharding (model.to(device))."
                )
    elif buffers:
        device = buffers[0][1]
    elif default_device_type(device_map, cuda_available=cuda_available) == "cuda":
        device = torch.device("cuda", current_cuda)
    else:
        device = torch.device("cpu")
    if device.type == "cuda" and device.index is None:
        # torch annotates ``device.index`` as int, but it is None for torch.device("cuda").
        device = torch.device("cuda", current_cuda)  # type: ignore[unreachable]
    check_communicable(device, device_map, backend, where=_where(params, sub_units, buffers))
    return device


def check_communicable(device: torch.device, device_map: Mapping[str, str], backend: str, *, where: str) -> None:
    """Raise unless the group communicates tensors on ``device`` (meta, or an unknown backend: accepted)."""
    if device.type == "meta" or not device_map or device.type in device_map:
        return
    served = ", ".join(f"{d} tensors with {b}" for d, b in sorted(device_map.items()))
    fix = (
        "init_process_group(backend='nccl') (or 'cpu:gloo,cuda:nccl', or no backend at all)"
        if device.type == "cuda"
        else f"a backend for {device.type} (e.g. 'cpu:gloo,cuda:nccl')"
    )
    want = " or ".join(sorted(device_map))
    raise ConfigurationError(
        f"{where} is on {device}, but the process group's backend {backend!r} communicates only {served}. "
        f"Move the model to {want} before sharding (model.to(...)), or create the process group with {fix}."
    )


def _where(
    params: Sequence[tuple[str, torch.device]],
    sub_units: Sequence[tuple[str, torch.device]],
    buffers: Sequence[tuple[str, torch.device]],
) -> str:
    if params:
        return f"parameter '{params[0][0]}'"
    if sub_units:
        return f"the unit {sub_units[0][0]!r} below this module"
    if buffers:
        return f"buffer '{buffers[0][0]}'"
    return "this module (no parameters, buffers or sharded submodules)"
