"""Both ways a sharded model's collectives reach torch, for the parity grids.

On gloo the engine runs all-gathers and reduce-scatters of CPU tensors as all-reduces, and gathers
in place (``engine/comm.py``); CUDA tensors under NCCL take the native ``all_gather_single`` /
``reduce_scatter_single`` calls and the rank-major copy-out. ``TorchCollectives(gloo_all_reduce=False)``
forces the native path on gloo, so every parity grid runs each configuration through both
transports inside its one launch and checks, per transport:

* the logical collectives (kind, bytes, group size, in order) are the same -- what a model asks for
  does not depend on how it travels;
* the wire bytes are each transport's ring cost: ``(n-1)/n`` of an all-gather or reduce-scatter sent
  natively, ``2(n-1)/n`` when it travels as an all-reduce;
* torch itself received the calls the transport claims: :func:`torch_calls` counts, independently
  of shardline's accounting, every ``all_gather_single``, ``reduce_scatter_single`` and
  ``all_reduce`` that reached ``torch.distributed``.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

import torch.distributed as dist
from torch import nn

import shardline
from shardline import _torch_compat
from shardline.engine import Collectives, TorchCollectives, use_collectives
from shardline.testing import FaultyCollectives, GradientFault

TRANSPORTS = ("all_reduce", "native")  # gloo's emulation (the CPU default) and NCCL's calls


def transports_for(world_size: int) -> tuple[str, ...]:
    """The transports worth running at ``world_size``: one rank issues no collective, so one suffices."""
    return TRANSPORTS if world_size > 1 else TRANSPORTS[:1]


Record = tuple[str, int, int, int]  # kind, logical bytes, wire bytes, group size


def backend(transport: str, fault: GradientFault | None = None) -> Collectives:
    """The collectives backend of ``transport``, with ``fault`` injected into averaging reductions."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    inner = TorchCollectives(gloo_all_reduce=transport == "all_reduce")
    return FaultyCollectives(fault, inner=inner) if fault is not None else inner


def through(model: nn.Module, transport: str, fault: GradientFault | None = None) -> Any:
    """``use_collectives(model, backend(transport, fault))``: issue ``model``'s collectives that way."""
    return use_collectives(model, backend(transport, fault))


@contextlib.contextmanager
def torch_calls() -> Iterator[Counter]:
    """Count the collectives that reach ``torch.distributed``: ``{name: calls}``, and ``{name + ' bytes': n}``."""
    calls: Counter = Counter()
    originals = (_torch_compat._all_gather, _torch_compat._reduce_scatter, dist.all_reduce)

    def spy(name: str, fn: Any, tensor_arg: int) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            tensor = args[tensor_arg]
            calls[name] += 1
            calls[f"{name} bytes"] += tensor.numel() * tensor.element_size()
            return fn(*args, **kwargs)

        return counted

    _torch_compat._all_gather = spy("all_gather", originals[0], 0)  # output: the gathered buffer
    _torch_compat._reduce_scatter = spy("reduce_scatter", originals[1], 1)  # input: the unreduced buffer
    dist.all_reduce = spy("all_reduce", originals[2], 0)
    try:
        yield calls
    finally:
        _torch_compat._all_gather, _torch_compat._reduce_scatter, dist.all_reduce = originals


def new_count() -> dict[str, Any]:
    """An empty tally for :func:`counted`."""
    return {"records": [], "torch": {}}


@contextlib.contextmanager
def counted(*models: nn.Module, into: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Add both views of the collectives ``models`` issue inside the block to ``into``.

    ``into["records"]``: shardline's records (kind, bytes, wire bytes, group size);
    ``into["torch"]``: the calls torch received (:func:`torch_calls`). Keep collectives of other
    code (a loss all-reduce) out of the block: torch's count would include them.
    """
    with shardline.count_collectives(*models) as counter, torch_calls() as calls:
        yield into
    into["records"].extend((r.kind.value, r.bytes, r.wire_bytes, r.group_size) for r in counter.records)
    for key, value in calls.items():
        into["torch"][key] = into["torch"].get(key, 0) + value


def _wire(kind: str, nbytes: int, n: int) -> int:
    if n <= 1:
        return 0
    return int(nbytes * (2.0 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n))


def check_transports(by_transport: dict[str, dict[str, Any]], where: str, *, native_expected: bool = True) -> None:
    """The checks of the module docstring, on what :func:`counted` saw under each transport."""
    logical = {t: [(k, b, n) for k, b, _w, n in seen["records"]] for t, seen in by_transport.items()}
    assert logical["native"] == logical["all_reduce"], f"{where}: the transports issued different collectives"
    for transport, seen in by_transport.items():
        records: Sequence[Record] = seen["records"]
        calls = Counter(seen["torch"])
        kinds = Counter(k for k, *_ in records)
        # Collectives shardline issues besides these three (broadcast, scatter) do not occur in a step.
        assert set(kinds) <= {"all_gather", "reduce_scatter", "all_reduce"}, f"{where}: {sorted(kinds)}"
        for kind, nbytes, wire, n in records:
            moved = kind
            if transport == "all_reduce" and n > 1 and kind in ("all_gather", "reduce_scatter") and nbytes % 4 == 0:
                moved = "all_reduce"  # fp32 / bf16 words travel as an all-reduce on gloo
            assert wire == _wire(moved, nbytes, n), f"{where} [{transport}]: {kind} of {nbytes} B over {n} ranks"
        # torch received exactly the calls of this transport (one-rank groups included).
        if transport == "native":
            for kind in ("all_gather", "reduce_scatter", "all_reduce"):
                assert calls[kind] == kinds[kind], f"{where} [native]: {kind} {calls[kind]} calls, {kinds[kind]} issued"
                logical_bytes = sum(b for k, b, _w, _n in records if k == kind)
                assert calls[f"{kind} bytes"] == logical_bytes, f"{where} [native]: {kind} bytes"
        else:
            assert calls["reduce_scatter"] == 0, f"{where} [all_reduce]: a native reduce-scatter on gloo"
            assert calls["all_reduce"] + calls["all_gather"] == sum(kinds.values()), f"{where} [all_reduce]"
    if native_expected:
        sharded = [k for k, *_r, n in by_transport["native"]["records"] if k != "all_reduce" and n > 1]
        assert sharded, f"{where}: no all-gather or reduce-scatter over several ranks ran through the native path"
