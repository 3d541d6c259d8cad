"""Small control messages between ranks (go/no-go verdicts, paths), sent with ``torch.distributed``.

Two helpers carry every decision of the checkpoint protocols, so that an error reaches every
rank as the same exception class with the same message (never a hang, never a rank that goes
on while another raised):

* :func:`rank0_decides` -- rank 0 runs a check or an action and every rank gets its result or
  its error (preflight of a save, the commit, opening a checkpoint, resolving a resume);
* :func:`all_agree` -- every rank runs a step and every rank learns whether all succeeded
  and every rank's result; :func:`all_succeed` (and :func:`all_succeed_total`) where only
  success matters (a directory's writability, the install of a load), in one all-reduce of a
  flag instead of an all-gather of every rank's frame.

Note: objects travel as JSON, or as ``torch.save`` bytes where JSON would not give them back equal,
in a uint8 tensor (a fixed-size frame holding the length and the start of the payload, then the
rest only if it did not fit) and are read back with ``json.loads`` or ``torch.load(weights_only=True)``,
so only plain data (dicts, lists, strings, numbers, tensors) crosses ranks, never arbitrary
pickles. Every call is a collective over ``group`` bounded by the group's timeout.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TypeVar, cast

import torch
import torch.distributed as dist

from shardline import _torch_compat, errors
from shardline.checkpoint.coordination.messages import is_json, json_bytes, json_value
from shardline.errors import CheckpointError, ShardlineError

__all__ = [
    "agreed_failure",
    "all_agree",
    "all_gather_object",
    "all_succeed",
    "all_succeed_total",
    "broadcast_object",
    "control_device",
    "error_from_payload",
    "error_payload",
    "group_rank",
    "group_size",
    "max_over_ranks",
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
    fast = json_bytes(obj)  # plain JSON data: read back in C (messages.py)
    if fast is not None:
        return fast
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _decode(data: bytes) -> Any:
    if is_json(data):
        return json_value(data)
    return torch.load(io.BytesIO(data), weights_only=True)


# Note: one round trip for a small message. A control message (a verdict, a path, a size) is a
# few hundred bytes, so the first collective carries a fixed-size frame -- the length, then the
# first ``_FRAME - 8`` bytes -- and only a longer message costs a second one for the rest
# (every rank learns the length from the first, so all take the same branch). Each saved round
# trip is one gloo (or NCCL) latency on every save, load and resume.
_FRAME = 4096
_HEAD = 8  # the little-endian int64 length at the start of a frame


def _frame(data: bytes) -> bytearray:
    """``data`` as a fixed-size frame: its length, then as much of it as fits (zero-padded)."""
    frame = bytearray(_FRAME)
    frame[:_HEAD] = len(data).to_bytes(_HEAD, "little")
    first = data[: _FRAME - _HEAD]
    frame[_HEAD : _HEAD + len(first)] = first
    return frame


def _unframe(frame: bytes) -> tuple[int, bytes]:
    """The length a frame announces, and the part of the message it carries."""
    length = int.from_bytes(frame[:_HEAD], "little")
    return length, bytes(frame[_HEAD : _HEAD + min(length, _FRAME - _HEAD)])


def broadcast_object(obj: Any, group: dist.ProcessGroup | None, *, src_rank: int = 0) -> Any:
    """``obj`` from group rank ``src_rank``, on every rank (plain data only; one collective when it is small)."""
    if group_size(group) == 1:
        return obj
    pg = _group(group)
    device = control_device(pg)
    src = dist.get_global_rank(pg, src_rank)
    is_src = dist.get_rank(pg) == src_rank
    data = _encode(obj) if is_src else b""
    if is_src:
        frame = torch.frombuffer(_frame(data), dtype=torch.uint8).to(device)
    else:
        frame = torch.empty(_FRAME, dtype=torch.uint8, device=device)
    dist.broadcast(frame, src=src, group=pg)
    if is_src:
        rest_len = len(data) - (_FRAME - _HEAD)
        if rest_len > 0:
            rest = torch.frombuffer(bytearray(data[_FRAME - _HEAD :]), dtype=torch.uint8).to(device)
            dist.broadcast(rest, src=src, group=pg)
        return obj
    length, head = _unframe(frame.cpu().numpy().tobytes())
    if length > len(head):
        rest = torch.empty(length - len(head), dtype=torch.uint8, device=device)
        dist.broadcast(rest, src=src, group=pg)
        head += rest.cpu().numpy().tobytes()
    return _decode(head)


def all_gather_object(obj: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """Every rank's ``obj``, in group-rank order (plain data only; one collective when every one is small)."""
    n = group_size(group)
    if n == 1:
        return [obj]
    pg = _group(group)
    device = control_device(pg)
    data = _encode(obj)
    send = torch.frombuffer(_frame(data), dtype=torch.uint8).to(device)
    frames = torch.empty(n * _FRAME, dtype=torch.uint8, device=device)
    _torch_compat.all_gather_into(frames, send, pg)
    rows = frames.view(n, _FRAME).cpu().numpy()
    parts = [_unframe(rows[r].tobytes()) for r in range(n)]
    width = max(length - len(head) for length, head in parts)
    if width > 0:  # some rank's message did not fit its frame: the rest of every one, padded to the longest
        tail = data[_FRAME - _HEAD :]
        rest = torch.zeros(width, dtype=torch.uint8, device=device)
        if tail:
            rest[: len(tail)] = torch.frombuffer(bytearray(tail), dtype=torch.uint8).to(device)
        out = torch.empty(n * width, dtype=torch.uint8, device=device)
        _torch_compat.all_gather_into(out, rest, pg)
        tails = out.view(n, width).cpu().numpy()
        parts = [(length, head + tails[r, : length - len(head)].tobytes()) for r, (length, head) in enumerate(parts)]
    return [_decode(head) for _, head in parts]


def max_over_ranks(value: int, group: dist.ProcessGroup | None) -> int:
    """The largest of every rank's ``value`` (a collective: one all-reduce of an int64, 8 bytes received per rank
    whatever the group's size; an ``all_gather_object`` of the values would receive every rank's pickle)."""
    if group_size(group) == 1:
        return value
    pg = _group(group)
    held = torch.tensor([value], dtype=torch.int64).to(control_device(pg))
    dist.all_reduce(held, op=dist.ReduceOp.MAX, group=pg)
    return int(held.item())


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


def _attempt(step: Callable[[], T]) -> tuple[Any, dict[str, str] | None, BaseException | None]:
    """Run ``step``: ``(its result, None, None)``, or ``(None, its error's payload, the error)`` if it raised."""
    try:
        return step(), None, None
    except Exception as e:
        return None, error_payload(e), e


def all_agree(step: Callable[[], T], group: dist.ProcessGroup | None, *, what: str) -> list[T]:
    """Run ``step`` on every rank; return every rank's result, or raise the same error on every rank.

    If some rank failed, every rank raises the failing rank's exception class (the lowest
    failing rank's), its message prefixed with ``rank R could not {what}`` unless every rank
    failed with the same message (then the message alone: all ranks saw the same problem).
    """
    value, failure, original = _attempt(step)
    outcomes = all_gather_object({"value": value} if failure is None else {"error": failure}, group)
    payload = agreed_failure([o.get("error") for o in outcomes], what=what)
    if payload is None:
        return [o["value"] for o in outcomes]
    raise_payload(payload, original)


# Note: agreement without the values. ``all_agree`` all-gathers a frame from every rank (4 KiB x W received
# per rank: 67 MB per call at 16,384 ranks) even when every step succeeded and no caller looks at the other
# ranks' results. Where only success matters, one all-reduce (SUM) of an int64 pair -- this rank failed (0/1),
# and an amount to add up -- is the whole agreement in the success path (16 bytes received, whatever W); only
# when some rank failed does a second collective gather the error payloads, so every rank raises the error
# ``all_agree`` would have raised (the same class, the same words, via ``agreed_failure``).
def _succeed(
    step: Callable[[], T], amount: Callable[[T], int], group: dist.ProcessGroup | None, what: str
) -> tuple[T, int]:
    """``step``'s result on this rank and the sum of ``amount(result)`` over the ranks, once all succeeded."""
    value, failure, original = _attempt(step)
    if group_size(group) == 1:
        if failure is not None:
            raise_payload(failure, original)  # as agreed_failure words a lone rank's failure: the message alone
        return value, amount(value)
    pg = _group(group)
    mine = [0, amount(value)] if failure is None else [1, 0]
    flags = torch.tensor(mine, dtype=torch.int64).to(control_device(pg))
    dist.all_reduce(flags, op=dist.ReduceOp.SUM, group=pg)
    failed, total = (int(x) for x in flags.cpu().tolist())
    if failed == 0:
        return value, total
    payload = agreed_failure(all_gather_object(failure, pg), what=what)
    assert payload is not None  # the flags counted a failure, so some rank sent its payload
    raise_payload(payload, original)


def all_succeed(step: Callable[[], T], group: dist.ProcessGroup | None, *, what: str) -> T:
    """Run ``step`` on every rank; return this rank's result once every rank's step succeeded, or raise on every
    rank the error :func:`all_agree` would raise (the same class and message).

    For a step whose other ranks' results are not needed: the success path is one all-reduce of a 16-byte
    flag, whatever the group's size; the error payloads are gathered only when some rank failed (see the note).
    """
    value, _ = _succeed(step, lambda _: 0, group, what)
    return value


def all_succeed_total(step: Callable[[], int], group: dist.ProcessGroup | None, *, what: str) -> int:
    """:func:`all_succeed` for a step that returns a count (bytes staged, say): the sum over the ranks, in the
    same all-reduce."""
    _, total = _succeed(step, lambda n: n, group, what)
    return total


def agreed_failure(failures: Sequence[dict[str, str] | None], *, what: str) -> dict[str, str] | None:
    """The one error every rank raises when some ranks failed a step (``failures``: per rank, its error payload
    or None), as :func:`all_agree` words it; None when no rank failed.

    For a step whose outcomes travel in another collective (a load's preparation rides in DCP's plan step).
    """
    failed = [(r, p) for r, p in enumerate(failures) if p is not None]
    if not failed:
        return None
    rank, payload = failed[0]
    if len(failed) < len(failures) or any(p != payload for _, p in failed):
        payload = {"type": payload["type"], "message": f"rank {rank} could not {what}: {payload['message']}"}
    return payload
