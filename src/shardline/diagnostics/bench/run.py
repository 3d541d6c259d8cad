"""Benchmark: shardline's sharding engine against torch FSDP2, torch DDP and one process.

Per model size: a main run at ``world_size`` ranks (every 1-D strategy, FSDP2, DDP, one
process), a hybrid run at 4 ranks on a 2x2 (replicate, shard) mesh (shardline HYBRID_SHARD vs
FSDP2's HSDP, ``fully_shard(mesh=2-D mesh)``), and a one-rank run. Two kinds of process groups each:

* **the timing run**: every rank builds every configuration (same seed, same weights, each
  rank its slice of the same global batch) and runs warm-up steps; then timing rounds run
  ``steps`` steps of each configuration in turn, the order rotated every round, so drift on a
  shared machine hits all of them alike. A step is forward + cross-entropy backward +
  ``AdamW.step()`` + ``zero_grad()``, timed on every rank after a barrier; a step lasts as long
  as its slowest rank, so its time is the maximum over ranks. "One process" is the plain model
  on the global batch on the first rank while the others wait in a barrier;
* **a probe run per configuration**: a fresh group that trains only that configuration, for
  its peak RSS (``/proc/self/clear_refs`` reset after warm-up, ``VmHWM`` after the steps) and
  its bytes per step (a dispatch mode sums every c10d collective; compared with the theory).

A one-rank timing run compares shardline FULL_SHARD at W=1 with the plain model on the global
batch. ``docs/benchmarks.md`` explains each choice.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.nn.parallel import DistributedDataParallel

import shardline
from shardline.diagnostics.bench import render as bench_render
from shardline.diagnostics.bench import results as bench_results
from shardline.diagnostics.bench.results import (
    PHASES,
    BenchResult,
    CommVolume,
    ConfigResult,
    RankMemory,
    RunResult,
    Spread,
    evaluate_targets,
)
from shardline.diagnostics.bench.settings import (
    HYBRID_MESH,
    HYBRID_RUN,
    MAIN_RUN,
    W1_RUN,
    BenchSettings,
    ModelSize,
)
from shardline.diagnostics.bench.theory import fsdp2_theory, issued_on_gloo, shardline_theory
from shardline.models.gpt import GPT, Block
from shardline.testing import run_distributed

__all__ = ["CONFIGS", "Configuration", "run_benchmark"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Configuration:
    """One way of training the model: who shards it, how, and on which ranks."""

    key: str
    label: str
    builder: str = "shardline"  # "shardline", "fsdp2", "ddp" or "plain"
    strategy: str = "full_shard"  # for builder "shardline"
    first_rank_only: bool = False  # the plain model on the global batch, on the first rank
    hybrid: bool = False  # on the hybrid run's (replicate, shard) mesh


CONFIGS: dict[str, Configuration] = {
    c.key: c
    for c in (
        Configuration(key="shardline_full_shard", label="shardline FULL_SHARD", strategy="full_shard"),
        Configuration(key="shardline_shard_grad_op", label="shardline SHARD_GRAD_OP", strategy="shard_grad_op"),
        Configuration(key="shardline_no_shard", label="shardline NO_SHARD", strategy="no_shard"),
        Configuration(key="shardline_shard_opt", label="shardline SHARD_OPT", strategy="shard_opt"),
        Configuration(key="torch_fsdp2", label="torch FSDP2", builder="fsdp2"),
        Configuration(key="torch_ddp", label="torch DDP", builder="ddp"),
        Configuration(key="one_process", label="one process, global batch", builder="plain", first_rank_only=True),
        Configuration(key="plain", label="plain model, global batch", builder="plain"),
        Configuration(
            key="shardline_hybrid_shard", label="shardline HYBRID_SHARD 2x2", strategy="hybrid_shard", hybrid=True
        ),
        Configuration(key="torch_fsdp2_hsdp", label="torch FSDP2 HSDP 2x2", builder="fsdp2", hybrid=True),
    )
}
if set(CONFIGS) != {*MAIN_RUN, *HYBRID_RUN, *W1_RUN} or any(CONFIGS[k].hybrid for k in MAIN_RUN):
    raise AssertionError("bench: CONFIGS and the runs named in bench.settings disagree")  # a bug, caught at import


# ---------------------------------------------------------------------------- what one rank runs
@dataclasses.dataclass(frozen=True, kw_only=True)
class _Plan:
    size: ModelSize
    configs: tuple[str, ...]
    micro_batch: int
    steps: int
    rounds: int
    warmup: int
    memory_steps: int
    seed: int
    lr: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Timing:
    """One rank's timing-run record of one configuration (``times`` None: the rank does not run it)."""

    times: tuple[tuple[float, float, float], ...] | None  # (forward, backward, optimizer) per timed step
    loss: float | None


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Probe:
    """One rank's probe-run record of one configuration: memory and bytes per step."""

    rss_method: str
    memory: RankMemory
    engine_memory: dict[str, int] | None
    comm: CommVolume


@dataclasses.dataclass
class _Live:
    """A configuration's model and optimizer on this rank (None where the rank does not run it)."""

    config: Configuration
    model: nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    inputs: torch.Tensor | None = None
    targets: torch.Tensor | None = None
    loss: float | None = None
    times: list[tuple[float, float, float]] = dataclasses.field(default_factory=list)


def _build(config: Configuration, size: ModelSize, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = GPT(size.gpt_config())
    mesh = None
    if config.hybrid:
        replicas, shard = HYBRID_MESH
        mesh = init_device_mesh("cpu", (replicas, shard), mesh_dim_names=("replicate", "shard"))
    if config.builder == "shardline":
        shardline.wrap(model, shardline.layer_policy(Block), strategy=config.strategy, mesh=mesh)
    elif config.builder == "fsdp2":  # with a 2-D mesh: FSDP2's HSDP
        for block in model.blocks:
            torch_fully_shard(block, mesh=mesh)
        torch_fully_shard(model, mesh=mesh)
    elif config.builder == "ddp":
        return DistributedDataParallel(model)
    return model


def _batch(plan: _Plan, config: Configuration, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of the global batch (all of it for the first-rank-only configuration)."""
    generator = torch.Generator().manual_seed(plan.seed + 1)
    global_batch = plan.micro_batch * world
    tokens = torch.randint(0, plan.size.vocab_size, (global_batch, plan.size.seq_len + 1), generator=generator)
    if not config.first_rank_only:
        tokens = tokens[rank * plan.micro_batch : (rank + 1) * plan.micro_batch]
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _setup(config: Configuration, plan: _Plan, rank: int, world: int) -> _Live:
    """Build one configuration on this rank and run its warm-up steps, keeping the first loss."""
    live = _Live(config=config)
    if config.first_rank_only and rank != 0:
        for _ in range(plan.warmup):
            dist.barrier()
        return live
    live.model = _build(config, plan.size, plan.seed)
    live.optimizer = torch.optim.AdamW(live.model.parameters(), lr=plan.lr)
    live.inputs, live.targets = _batch(plan, config, rank, world)
    for i in range(plan.warmup):
        dist.barrier()
        loss = _step(live)[3]
        if i == 0:
            live.loss = float(loss)
    return live


def _step(live: _Live, *, zero_grad: bool = True) -> tuple[float, float, float, torch.Tensor]:
    """One training step; returns (forward, backward, optimizer) seconds and the loss."""
    assert live.model is not None
    assert live.optimizer is not None
    assert live.inputs is not None
    assert live.targets is not None
    t0 = time.perf_counter()
    logits = live.model(live.inputs)
    loss = F.cross_entropy(logits.flatten(0, 1), live.targets.flatten())
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    live.optimizer.step()
    if zero_grad:
        live.optimizer.zero_grad(set_to_none=True)
    return t1 - t0, t2 - t1, time.perf_counter() - t2, loss.detach()


def _timing_main(rank: int, world: int, plan: _Plan) -> dict[str, _Timing]:
    """The timing run: every configuration built in this process, steps alternating in rotating order."""
    lives = [_setup(CONFIGS[key], plan, rank, world) for key in plan.configs]
    for r in range(plan.rounds):
        shift = r % len(lives)
        for live in lives[shift:] + lives[:shift]:
            for _ in range(plan.steps):
                dist.barrier()
                if live.model is not None:
                    live.times.append(_step(live)[:3])
    return {
        live.config.key: _Timing(times=tuple(live.times) if live.model is not None else None, loss=live.loss)
        for live in lives
    }


def _probe_main(rank: int, world: int, plan: _Plan) -> _Probe:
    """A probe run: a fresh process group that trains one configuration, for its memory and bytes.

    Alone in the process, the configuration's RSS is not mixed up with other models' or with
    memory the allocator kept from them. Peak RSS is ``VmHWM`` over the steps after warm-up
    (the high-water mark reset through ``/proc/self/clear_refs`` once the model is built).
    """
    (key,) = plan.configs
    probe = _RssProbe()
    probe.settle()
    baseline = probe.rss()
    live = _setup(CONFIGS[key], plan, rank, world)
    assert live.model is not None  # every rank runs a memory probe's one config
    assert live.optimizer is not None
    probe.settle()
    before = probe.rss()
    probe.reset_peak()
    if live.config.builder == "shardline":
        shardline.reset_peak_memory_stats(live.model)
    for i in range(plan.memory_steps):
        last = i == plan.memory_steps - 1
        _step(live, zero_grad=not last)
    hwm = probe.hwm()
    engine = None
    if live.config.builder == "shardline":
        engine = shardline.memory_stats(live.model, optimizer=live.optimizer).as_dict()
    live.optimizer.zero_grad(set_to_none=True)
    state = None if before is None or baseline is None else before - baseline
    step = None if hwm is None or before is None else max(0, hwm - before)
    memory = RankMemory(rank=rank, baseline=baseline, state=state, step=step, hwm=hwm)
    return _Probe(rss_method=probe.method, memory=memory, engine_memory=engine, comm=_measure_comm(live, plan, world))


def _measure_comm(live: _Live, plan: _Plan, world: int) -> CommVolume:
    """Bytes per step: every c10d collective of one step, shardline's own log, and the theory."""
    dist.barrier()
    assert live.model is not None  # measured on the ranks that run the config
    engine_log = (
        shardline.count_collectives(live.model)
        if live.config.builder == "shardline"
        else contextlib.nullcontext(shardline.CommCounter())
    )
    with _C10dCounter() as counter, engine_log as log:
        _step(live)
    engine: dict[str, int] | None = None
    if live.config.builder == "shardline":
        engine = {}
        for record in log.records:
            engine[record.kind.value] = engine.get(record.kind.value, 0) + record.bytes
    theory = _theory(live, plan.size, world)
    issued = issued_on_gloo(theory) if live.config.builder == "shardline" and world > 1 else None
    return CommVolume(theory=theory, measured=counter.volume, engine=engine, issued=issued)


# ---------------------------------------------------------------------------- theory
def _theory(live: _Live, size: ModelSize, world: int) -> dict[str, int]:
    if live.config.builder == "shardline":
        assert live.model is not None
        return shardline_theory(live.model)
    if live.config.builder == "plain" or world == 1:
        return {}
    with torch.device("meta"):
        model = GPT(size.gpt_config())
    if live.config.builder == "ddp":
        return {"all_reduce": sum(p.numel() * p.element_size() for p in model.parameters())}
    return fsdp2_theory(model, world, shard=HYBRID_MESH[1] if live.config.hybrid else None)


# ---------------------------------------------------------------------------- measuring
# c10d op -> (kind, index of the argument holding the collective's full buffer).
_C10D_OPS = {
    "c10d::_allgather_base_": ("all_gather", 0),
    "c10d::allgather_": ("all_gather", 0),
    "c10d::allgather_coalesced_": ("all_gather", 0),
    "c10d::allgather_into_tensor_coalesced_": ("all_gather", 0),
    "c10d::_reduce_scatter_base_": ("reduce_scatter", 1),
    "c10d::reduce_scatter_": ("reduce_scatter", 1),
    "c10d::reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "c10d::allreduce_": ("all_reduce", 0),
    "c10d::allreduce_coalesced_": ("all_reduce", 0),
    "c10d::broadcast_": ("broadcast", 0),
}


class _C10dCounter(CommDebugMode):
    """Sums the logical bytes of every c10d collective issued inside the block, whoever issues it.

    ``CommDebugMode`` is torch's public dispatch mode for collectives; it counts calls but not
    bytes, and its module tracker breaks on a module called twice in one forward (``Block``
    calls its dropout twice), so this subclass enters only the dispatch mode and records sizes.
    DTensor operations are let through to DTensor first, as ``CommDebugMode`` does, so the
    collectives they expand to are seen too. Collectives it does not know are counted as
    ``other:<op>`` with the bytes of all their tensors.
    """

    # torch leaves these unannotated, and mypy does not apply untyped_calls_exclude through super().
    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.volume: dict[str, int] = {}

    def __enter__(self) -> _C10dCounter:
        super(CommDebugMode, self).__enter__()  # type: ignore[no-untyped-call]
        return self

    def __exit__(self, *exc: object) -> None:
        super(CommDebugMode, self).__exit__(*exc)  # type: ignore[no-untyped-call]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(t is DTensor for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        name = func.name() if callable(getattr(func, "name", None)) else ""
        if name.startswith("c10d::") and name != "c10d::barrier":
            kind, index = _C10D_OPS.get(name, (f"other:{name}", None))
            held = args[index] if index is not None and index < len(args) else args
            self.volume[kind] = self.volume.get(kind, 0) + _tensor_bytes(held)
        return out


def _tensor_bytes(obj: object) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(x) for x in obj)
    return 0


class _RssProbe:
    """This process's RSS and its high-water mark (Linux ``/proc``), with a resettable peak."""

    def __init__(self) -> None:
        self.method = "clear_refs"
        if self._status("VmRSS") is None:
            self.method = "unavailable (no /proc/self/status)"
        try:
            self._trim: Callable[[int], int] | None = ctypes.CDLL(None).malloc_trim
        except (AttributeError, OSError):  # not glibc
            self._trim = None

    @staticmethod
    def _status(key: str) -> int | None:
        try:
            text = Path("/proc/self/status").read_text()
        except OSError:
            return None
        match = re.search(rf"^{key}:\s+(\d+) kB", text, re.MULTILINE)
        return int(match.group(1)) * 1024 if match else None

    def settle(self) -> None:
        """Collect garbage and give free heap pages back to the OS, so RSS is what is live."""
        gc.collect()
        if self._trim is not None:
            self._trim(0)

    def rss(self) -> int | None:
        return self._status("VmRSS")

    def hwm(self) -> int | None:
        return self._status("VmHWM")

    def reset_peak(self) -> None:
        if self.method != "clear_refs":
            return
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            self.method = "VmHWM since process start (writing /proc/self/clear_refs was refused)"


# ---------------------------------------------------------------------------- the driver
def run_benchmark(
    *,
    settings: BenchSettings | None = None,
    out_dir: str | Path | None = None,
    command: str | None = None,
    plot: bool = True,
    progress: Callable[[str], None] | None = None,
) -> BenchResult:
    """Run the comparison for every size (and the W=1 comparison); write results if ``out_dir``.

    Writes ``results.json``, ``results.md`` and (with ``plot``) ``results.png`` into ``out_dir``.

    Raises:
        ConfigurationError: Bad settings, or ``plot`` without matplotlib installed.
    """
    settings = settings or BenchSettings()
    settings.validate()
    if out_dir is not None:
        if plot:
            bench_render.require_matplotlib()
        bench_render.prepare_out_dir(out_dir)
    say = progress or (lambda _msg: None)
    runs: list[RunResult] = []
    for size in settings.sizes:
        probes: dict[tuple[Any, ...], list[_Probe]] = {}  # the plain model on one rank serves two rows
        jobs = [("main", settings.main_configs, settings.world_size, settings.micro_batch)]
        if settings.hybrid:
            jobs.append(("hybrid", HYBRID_RUN, HYBRID_MESH[0] * HYBRID_MESH[1], settings.micro_batch))
        if settings.w1:
            jobs.append(("w1", W1_RUN, 1, settings.micro_batch * settings.world_size))
        for kind, keys, world, micro_batch in jobs:
            say(f"{size.name} ({size.describe()}), {world} rank(s): timing {', '.join(keys)} ...")
            plan = _plan(settings, size, keys, micro_batch)
            start = time.perf_counter()
            timing = run_distributed(_timing_main, world, args=(plan,), timeout=settings.timeout_s)
            wall = time.perf_counter() - start
            say(f"  {wall:.0f} s; now memory and bytes per step, one process group per configuration ...")
            by_key = {}
            for key in keys:
                config = CONFIGS[key]
                probe_world = 1 if config.first_rank_only else world
                probe_plan = _plan(settings, size, (key,), micro_batch * world // probe_world)
                memo = (config.builder, config.strategy, config.hybrid, probe_world, probe_plan.micro_batch)
                if memo not in probes:
                    probes[memo] = run_distributed(
                        _probe_main, probe_world, args=(probe_plan,), timeout=settings.timeout_s
                    )
                by_key[key] = probes[memo]
            runs.append(_combine(kind, plan, world, timing, by_key, wall))
    result = BenchResult(settings=settings, environment=bench_results.environment(command), runs=tuple(runs))
    result = dataclasses.replace(result, targets=evaluate_targets(result))
    if out_dir is not None:
        bench_render.write_results(result, out_dir=out_dir, plot=plot)
    return result


def _plan(settings: BenchSettings, size: ModelSize, keys: tuple[str, ...], micro_batch: int) -> _Plan:
    return _Plan(
        size=size,
        configs=keys,
        micro_batch=micro_batch,
        steps=settings.steps,
        rounds=settings.rounds,
        warmup=settings.warmup,
        memory_steps=settings.memory_steps,
        seed=settings.seed,
        lr=settings.lr,
    )


def _combine(
    kind: str,
    plan: _Plan,
    world: int,
    timing: list[dict[str, _Timing]],
    probes: dict[str, list[_Probe]],
    wall: float,
) -> RunResult:
    """One :class:`RunResult` from every rank's timing record and each configuration's probe run."""
    configs = []
    for key in plan.configs:
        ran = [t[key] for t in timing if t[key].times is not None]
        steps = list(zip(*(t.times for t in ran if t.times is not None), strict=True))
        phases = {name: Spread.of([max(t[i] for t in step) for step in steps]) for i, name in enumerate(PHASES)}
        losses = [t.loss for t in ran if t.loss is not None]
        configs.append(
            ConfigResult(
                key=key,
                label=CONFIGS[key].label,
                ranks=len(ran),
                tokens_per_step=plan.micro_batch * world * plan.size.seq_len,
                step=Spread.of([max(sum(t) for t in step) for step in steps]),
                rank_steps=tuple(tuple(sum(t) for t in r.times) for r in ran if r.times is not None),
                phases=phases,
                memory=tuple(p.memory for p in probes[key]),
                engine_memory=probes[key][0].engine_memory,
                comm=probes[key][0].comm,
                first_loss=sum(losses) / len(losses),
            )
        )
    return RunResult(
        kind=kind,
        size=plan.size,
        world_size=world,
        micro_batch=plan.micro_batch,
        rss_method=next(iter(probes.values()))[0].rss_method,
        wall_s=wall,
        configs=tuple(configs),
    )
