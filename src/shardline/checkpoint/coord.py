"""Small control messages between ranks (go/no-go verdicts, paths), sent with ``torch.distributed``.

Note: objects travel as ``torch.save`` bytes in a uint8 tensor (a length broadcast, then the
payload) and are read back with ``torch.load(weights_only=True)``, so only plain data (dicts,
lists, strings, numbers, tensors) crosses ranks, never arbitrary pickles. Every call is a
collective over ``group`` bounded by the group's timeout.
"""

from __future__ import annotations

import io
from typing import Any

import torch
import torch.distributed as dist

from shardline import _torch_compat

__all__ = ["all_gather_object", "broadcast_object", "control_device", "group_rank", "group_size"]


def _group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    return group if group is not None else dist.group.WORLD


def group_size(group: dist.ProcessGroup | None) -> int:
    """Ranks in ``group`` (1 when torch.distributed is not initialized)."""
    if not dist.is_initialized():
        return 1
    return dist.get_world_size(_group(group))


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank in ``group`` (0 when torch.distributed is not initialized)."""
    if not dist.is_initialized():
        return 0
    return dist.get_rank(_group(group))


def control_device(group: dist.ProcessGroup) -> torch.device:
    backend = str(dist.get_backend(group))
    if "gloo" in backend or "cpu" in backend:
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _encode(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _decode(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)


def broadcast_object(obj: Any, group: dist.ProcessGroup | None, *, src_rank: int = 0) -> Any:
    """``obj`` from group rank ``src_rank``, on every rank (plain data only)."""
    if group_size(group) == 1:
        return obj
    pg = _group(group)
    device = control_device(pg)
    is_src = dist.get_rank(pg) == src_rank
    data = _encode(obj) if is_src else b""
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(length, src=dist.get_global_rank(pg, src_rank), group=pg)
    if is_src:
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    else:
        payload = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    dist.broadcast(payload, src=dist.get_global_rank(pg, src_rank), group=pg)
    return obj if is_src else _decode(payload.cpu().numpy().tobytes())


def all_gather_object(obj: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """Every rank's ``obj``, in group-rank order (plain data only)."""
    n = group_size(group)
    if n == 1:
        return [obj]
    pg = _group(group)
    device = control_device(pg)
    data = _encode(obj)
    mine = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lengths = torch.empty(n, dtype=torch.int64, device=device)
    _torch_compat.all_gather_into(lengths, mine, pg)
    width = int(lengths.max().item())
    send = torch.zeros(width, dtype=torch.uint8, device=device)
    if data:
        send[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    out = torch.empty(n * width, dtype=torch.uint8, device=device)
    _torch_compat.all_gather_into(out, send, pg)
    rows = out.view(n, width).cpu()
    return [_decode(rows[r, : int(lengths[r].item())].numpy().tobytes()) for r in range(n)]
