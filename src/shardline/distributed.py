"""Process-group setup for scripts: join a torchrun job, or make a one-process group."""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardline import _teardown
from shardline.engine.device import backend_device_map

__all__ = ["DistInfo", "free_port", "init_distributed"]

# Every process that imports shardline lets its gloo worker threads settle before the interpreter tears down
# (a collective's last tensor dropped during teardown aborts the process; see shardline._teardown).
_teardown.install()

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def init_distributed(*, backend: str | None = None, timeout: datetime.timedelta | float = 600.0) -> DistInfo:
    """Initialize ``torch.distributed`` if needed and describe this process.

    Under torchrun (``RANK``/``WORLD_SIZE``/``MASTER_*`` set) it joins that job; otherwise it
    creates a one-rank group so the same script runs as a single process. ``backend`` defaults
    to NCCL when CUDA is available, else gloo. ``timeout`` (seconds or timedelta) bounds every
    collective, so a dead peer produces an error instead of a hang.

    ``device`` is ``cuda:LOCAL_RANK`` whenever the backend communicates CUDA tensors through NCCL
    (``"nccl"``, ``"cpu:gloo,cuda:nccl"``) and CUDA is available -- selected before the group is
    created -- else the CPU.
    """
    if isinstance(timeout, (int, float)):
        timeout = datetime.timedelta(seconds=timeout)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    cuda_backend = backend_device_map(backend).get("cuda")
    nccl = cuda_backend == "nccl" and torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if nccl else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        if all(v in os.environ for v in _TORCHRUN_VARS):
            dist.init_process_group(backend=backend, timeout=timeout)
        else:
            dist.init_process_group(
                backend=backend,
                init_method=f"tcp://127.0.0.1:{free_port()}",
                rank=0,
                world_size=1,
                timeout=timeout,
            )
    return DistInfo(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        backend=str(dist.get_backend()),
        device=device,
    )
