"""Small control messages between ranks (go/no-go verdicts, paths), sent with ``torch.distributed``.

Two helpers carry every decision of the checkpoint protocols, so that an error reaches every
rank as the same exception class with the same message (never a hang, never a rank that goes
on while another raised):

* :func:`rank0_decides` -- rank 0 runs a check or an action and every rank gets its result or
  its error (preflight of a save, the commit, opening a checkpoint, resolving a resume);
* :func:`all_agree` -- every rank runs a step and every rank learns whether all succeeded
  (staging a save, checking a model against a checkpoint).

Note: objects travel as ``torch.save`` bytes in a uint8 tensor (a length broadcast, then the
payload) and are read back with ``torch.load(weights_only=True)``, so only plain data (dicts,
lists, strings, numbers, tensors) crosses ranks, never arbitrary pickles. Every call is a
collective over ``group`` bounded by the group's timeout.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar, cast

import torch
import torch.distributed as dist

from shardline import _torch_compat, errors
from shardline.errors import CheckpointError, ShardlineError

__all__ = [
    "all_agree",
    "all_gather_object",
    "broadcast_object",
    "control_device",
    "error_from_payload",
    "error_payload",
    "group_rank",
    "group_size",
    "raise_payload",
    "rank0_decides",
]

T = TypeVar("T")


def _group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    # Only called once torch.distributed is initialized, when the world group exists.
    return group if group is not None else cast(dist.ProcessGroup, dist.group.WORLD)


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


def control_device(group: dist.ProcessGroup | None) -> torch.device:
    """The device the control messages of ``group`` travel on: CUDA only if the group has a CUDA backend.

    Note: a group's backend name is not always a backend. One made before any device was named
    (Accelerate's ``PartialState()`` ahead of ``TrainingArguments``) reads ``"undefined"``, and
    a multi-device one ``"cpu:gloo,cuda:nccl"``; the per-device configuration says which device
    types it serves. CPU whenever it serves CPU, or when this process has no CUDA.
    """
    backend = str(dist.get_backend(group))
    if "gloo" in backend or "cpu" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    try:
        config = str(dist.get_backend_config(group))
    except (RuntimeError, ValueError):
        config = backend
    if "cpu" in config or "gloo" in config or ("cuda" not in config and "nccl" not in config):
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


def error_payload(exc: BaseException) -> dict[str, str]:
    """An error as plain data: its shardline class name and message (other errors become ``CheckpointError``)."""
    if isinstance(exc, ShardlineError):
        return {"type": type(exc).__name__, "message": str(exc)}
    return {"type": CheckpointError.__name__, "message": f"{type(exc).__name__}: {exc}"}


def _error_class(name: str) -> type[ShardlineError]:
    cls = getattr(errors, name, None)
    return cls if isinstance(cls, type) and issubclass(cls, ShardlineError) else CheckpointError


def error_from_payload(payload: dict[str, str]) -> ShardlineError:
    """The error :func:`error_payload` described: the same shardline class, the same message."""
    return _error_class(payload["type"])(payload["message"])


def raise_payload(payload: dict[str, str], cause: BaseException | None = None) -> NoReturn:
    """Raise the error :func:`error_payload` described (chained to ``cause`` where this rank has it)."""
    raise error_from_payload(payload) from cause


def rank0_decides(decide: Callable[[], T], group: dist.ProcessGroup | None) -> T:
    """Run ``decide`` on group rank 0 and give its result, or its error, to every rank (a collective).

    ``decide``'s result must be plain data (see the module note). If it raises, every rank --
    rank 0 included -- raises the same shardline exception class with the same message; a
    non-shardline error becomes a ``CheckpointError`` naming its type.
    """
    outcome: dict[str, Any] = {}
    original: BaseException | None = None
    if group_rank(group) == 0:
        try:
            outcome = {"value": decide()}
        except Exception as e:
            original = e
            outcome = {"error": error_payload(e)}
    outcome = broadcast_object(outcome, group)
    if "error" in outcome:
        raise_payload(outcome["error"], original)
    value: T = outcome["value"]  # decide()'s result, broadcast from rank 0
    return value


def all_agree(step: Callable[[], T], group: dist.ProcessGroup | None, *, what: str) -> list[T]:
    """Run ``step`` on every rank; return every rank's result, or raise the same error on every rank.

    If some rank failed, every rank raises the failing rank's exception class (the lowest
    failing rank's), its message prefixed with ``rank R could not {what}`` unless every rank
    failed with the same message (then the message alone: all ranks saw the same problem).
    """
    value: Any = None
    failure: dict[str, str] | None = None
    original: BaseException | None = None
    try:
        value = step()
    except Exception as e:
        original = e
        failure = error_payload(e)
    outcomes = all_gather_object({"value": value} if failure is None else {"error": failure}, group)
    failed = [(r, o["error"]) for r, o in enumerate(outcomes) if "error" in o]
    if not failed:
        return [o["value"] for o in outcomes]
    rank, payload = failed[0]
    if len(failed) < len(outcomes) or any(p != payload for _, p in failed):
        payload = {"type": payload["type"], "message": f"rank {rank} could not {what}: {payload['message']}"}
    raise_payload(payload, original)
