"""The time model: one training step of a configuration on a cluster, from FLOPs, bytes and rates.

A step is ``A = global_batch / (W * micro_batch)`` micro-batches of forward and backward, then
the optimizer step. For each micro-batch (every collective is issued again per micro-batch:
gradient accumulation without ``no_sync``):

* compute: forward FLOPs at the device's achieved rate (peak x ``compute`` efficiency), backward
  twice that, plus the forward work activation checkpointing repeats (:mod:`.architecture`);
* communication, per strategy, the volumes of ``docs/engine.md`` (the formulas the engine's byte
  counts are tested against, :func:`shardline.diagnostics.bench.theory.shardline_theory`), with
  ``Psi`` parameters, ``p``/``r`` bytes per parameter / reduced gradient, ``S`` ranks per shard group:
  forward all-gather ``Psi*p`` (ZeRO-2/3), a second one in backward for the blocks except the last
  when parameters are freed after forward (ZeRO-3), reduce-scatter ``Psi*r``, plus an all-reduce of
  ``Psi*r/S`` across replicas (hybrid); ZeRO-1 all-reduces ``Psi*r`` and all-gathers the fp32
  rows ``Psi*4`` before every micro-batch (the engine gathers again after every reduction);
  ZeRO-0 all-reduces ``Psi*r``;
* a ring collective over ``n`` ranks moves ``(n-1)/n`` of the buffer per rank (twice that for an
  all-reduce) at the group's bus bandwidth: the intra-node link when the group is inside one
  node, else ``min(intra, k * inter)`` for ``k`` group members per node (the node's NICs carry one
  copy of the data in and out, NVLink spreads it), times the ``link`` efficiency. On gloo (CPU)
  shardline issues all-gathers and reduce-scatters as all-reduces of the same buffer, and
  ``--calibrate`` measures each kind through shardline's own collectives, copies included;
* overlap (GPU: comm streams): forward takes ``first + max(compute, comm - first)``, where
  ``first`` is the gather of the root unit and the first block, which nothing hides; backward takes
  ``max(compute + recompute, comm - last) + last``, where ``last`` is the reduction of the root
  and the last block, issued after the last gradient. Prefetch is one unit ahead, so a gather is
  hidden behind the previous unit's compute. On CPU nothing overlaps: compute and gloo's
  reductions share the cores.

The optimizer step streams ``28`` bytes per local trainable parameter (AdamW reads parameter,
gradient and two moments, writes three) at the ``memory`` efficiency of the memory bandwidth.

On a calibrated CPU the engine's own memory work (copies into and out of the collectives'
buffers, zeroed gather buffers, buffers allocated anew each step: :mod:`.host_traffic`) is
charged at the copy, fill and first-touch rates ``--calibrate`` measured; it overlaps nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from shardline.diagnostics.plan.architecture import ActivationCheckpointing, Architecture
from shardline.diagnostics.plan.devices import Device, DeviceClass
from shardline.diagnostics.plan.host_traffic import backward_regather_params, host_traffic
from shardline.diagnostics.plan.memory import MemoryBreakdown, plan_memory
from shardline.engine import ShardingStrategy
from shardline.errors import ConfigurationError

__all__ = ["ADAMW_BYTES_PER_PARAM", "USABLE_MEMORY_FRACTION", "Candidate", "Cluster", "Prediction", "Training",
           "accumulation_steps", "predict", "step_volume"]  # fmt: skip

ADAMW_BYTES_PER_PARAM = 28  # fp32 parameter, gradient, two moments read; parameter and moments written
USABLE_MEMORY_FRACTION = 0.95  # of the device's memory: the rest is the CUDA context, NCCL and fragmentation


@dataclasses.dataclass(frozen=True, kw_only=True)
class Cluster:
    """Where the model trains: ``nodes`` x ``gpus_per_node`` devices, and their links.

    Attributes:
        device: The device (:func:`~.devices.get_device`, or measured by ``--calibrate``).
        nodes: Machines.
        gpus_per_node: Devices (ranks) per machine.
        intra_node_gbps: Link between devices of one node, per device and direction, Gb/s
            (default: the device's NVLink or PCIe).
        inter_node_gbps: Network per device across nodes, Gb/s (default: the device's usual NIC).
    """

    device: Device
    nodes: int = 1
    gpus_per_node: int = 8
    intra_node_gbps: float | None = None
    inter_node_gbps: float | None = None

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node"):
            if getattr(self, name) < 1:
                raise ConfigurationError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("intra_node_gbps", "inter_node_gbps"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigurationError(f"--{name.replace('_', '-')} must be > 0, got {value}")

    @property
    def world_size(self) -> int:
        """Ranks in all."""
        return self.nodes * self.gpus_per_node

    def bus_bytes_per_s(self, group: int, stride: int = 1) -> float:
        """Ring bus bandwidth of a group of ``group`` ranks ``stride`` apart (ranks fill nodes in order)."""
        intra = (self.intra_node_gbps or self.device.intra_node_gbps) * 1e9 / 8
        inter = (self.inter_node_gbps or self.device.inter_node_gbps) * 1e9 / 8
        per_node = max(1, min(group, self.gpus_per_node // stride)) if stride <= self.gpus_per_node else 1
        spans_nodes = group * stride > self.gpus_per_node
        bw = min(intra, per_node * inter) if spans_nodes else intra
        return bw * self.device.efficiency.link


@dataclasses.dataclass(frozen=True, kw_only=True)
class Training:
    """What is trained: sequences of ``seq_len`` tokens, ``global_batch`` sequences per step, dtypes.

    Attributes:
        seq_len: Tokens per sequence.
        global_batch: Sequences per optimizer step over all ranks.
        param_dtype: Dtype of gathered parameters and of compute (bf16, or fp32 without mixed precision).
        reduce_dtype: Dtype gradients are reduced in.
    """

    seq_len: int
    global_batch: int
    param_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        for name in ("seq_len", "global_batch"):
            if getattr(self, name) < 1:
                raise ConfigurationError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Candidate:
    """One way to train: strategy, hybrid shard size, ``reshard_after_forward``, micro-batch, checkpointing."""

    strategy: ShardingStrategy
    micro_batch: int
    ac: ActivationCheckpointing
    shard_size: int | None = None
    reshard_after_forward: bool | int | None = None

    @property
    def label(self) -> str:
        """Short description for tables."""
        parts = [self.strategy.name]
        if self.shard_size:
            parts.append(f"shard {self.shard_size}")
        if isinstance(self.reshard_after_forward, int) and not isinstance(self.reshard_after_forward, bool):
            parts.append(f"reshard to {self.reshard_after_forward}")
        return " ".join(parts) + f", mb {self.micro_batch}, AC {self.ac.value}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Prediction:
    """Predicted step of one :class:`Candidate` (times in seconds per step, per rank)."""

    candidate: Candidate
    step_time_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    tflops_per_gpu: float
    peak_memory_gib: float
    fits: bool
    compute_s: float
    recompute_s: float
    exposed_comm_s: float
    comm_s: float
    optimizer_s: float
    grad_accum: int
    memory: MemoryBreakdown
    engine_memory_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        """The ``--json`` record."""
        c = self.candidate
        return {
            "strategy": c.strategy.value,
            "shard_size": c.shard_size,
            "reshard_after_forward": c.reshard_after_forward,
            "micro_batch": c.micro_batch,
            "ac": c.ac.value,
            "grad_accum": self.grad_accum,
            "step_time_s": self.step_time_s,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "mfu": self.mfu,
            "tflops_per_gpu": self.tflops_per_gpu,
            "peak_memory_gib": self.peak_memory_gib,
            "fits": self.fits,
            "time_split_s": {
                "compute": self.compute_s,
                "recompute": self.recompute_s,
                "exposed_comm": self.exposed_comm_s,
                "optimizer": self.optimizer_s,
                "engine_memory": self.engine_memory_s,
            },
            "comm_total_s": self.comm_s,
            "memory_gib": {
                "steady": self.memory.steady / 2**30,
                "transient": self.memory.transient / 2**30,
                "activations": self.memory.activations / 2**30,
            },
        }


@dataclasses.dataclass(frozen=True)
class _Collective:
    kind: str  # "all_gather", "reduce_scatter", "all_reduce"
    nbytes: float  # the whole buffer (gathered / reduced size)
    group: int
    stride: int
    phase: str  # "forward" or "backward" (of every micro-batch)
    edge: float  # the share that cannot overlap (first gather / last reduction)


def accumulation_steps(cluster: Cluster, training: Training, micro_batch: int) -> int:
    """Micro-batches per step, or a one-line error when the batch does not split evenly."""
    world = cluster.world_size
    if training.global_batch % world:
        up = -(-training.global_batch // world) * world
        raise ConfigurationError(
            f"--global-batch {training.global_batch} is not divisible by the world size {world} "
            f"({cluster.nodes} nodes x {cluster.gpus_per_node}); use a multiple of {world}, e.g. {up}"
        )
    local = training.global_batch // world
    if micro_batch < 1 or local % micro_batch:
        raise ConfigurationError(
            f"--micro-batch {micro_batch} does not divide the {local} sequences per rank "
            f"(--global-batch {training.global_batch} / {world} ranks); choose a divisor of {local}"
        )
    return local // micro_batch


def _collectives(arch: Architecture, cluster: Cluster, training: Training, c: Candidate) -> list[_Collective]:
    world = cluster.world_size
    knobs = c.strategy.policy
    shard = (c.shard_size or world) if knobs.hybrid else world
    replicas = world // shard
    psi = float(arch.num_params)
    p = training.param_dtype.itemsize
    r = training.reduce_dtype.itemsize
    edge_first = (arch.root_params + arch.block_params) / psi
    edge_last = (arch.root_params + arch.block_params) / psi
    out: list[_Collective] = []
    if knobs.shard_params and shard > 1:
        out.append(_Collective("all_gather", psi * p, shard, 1, "forward", edge_first))
        regathered, again = backward_regather_params(
            arch, policy=knobs, shard=shard, reshard_after_forward=c.reshard_after_forward
        )
        if regathered:
            out.append(_Collective("all_gather", regathered * p, again, 1, "backward", 0.0))
        out.append(_Collective("reduce_scatter", psi * r, shard, 1, "backward", edge_last))
        if replicas > 1:
            out.append(_Collective("all_reduce", psi * r / shard, replicas, shard, "backward", edge_last))
    elif knobs.shard_optimizer and not knobs.shard_params and world > 1:  # ZeRO-1
        out.append(_Collective("all_reduce", psi * r, world, 1, "backward", edge_last))
        # Every micro-batch's forward: each reduction marks the rows for gathering again (docs/planning.md).
        out.append(_Collective("all_gather", psi * 4, world, 1, "forward", edge_first))
    elif world > 1:  # ZeRO-0
        out.append(_Collective("all_reduce", psi * r, world, 1, "backward", edge_last))
    return out


def step_volume(arch: Architecture, *, cluster: Cluster, training: Training, candidate: Candidate) -> dict[str, int]:
    """Bytes per step by collective kind (each buffer's whole size, as the engine's counters report it)."""
    accum = accumulation_steps(cluster, training, candidate.micro_batch)
    volume: dict[str, float] = {}
    for coll in _collectives(arch, cluster, training, candidate):
        times = accum
        volume[coll.kind] = volume.get(coll.kind, 0.0) + coll.nbytes * times
    return {kind: round(n) for kind, n in volume.items()}


def _seconds(coll: _Collective, cluster: Cluster) -> float:
    n = coll.group
    if n <= 1:
        return 0.0
    factor = 2.0 if coll.kind == "all_reduce" else 1.0
    measured = dict(cluster.device.measured_bus_gbps)
    if coll.kind in measured:  # calibrated through shardline's own collectives: their path included
        return factor * coll.nbytes * (n - 1) / n / (measured[coll.kind] * 1e9 / 8)
    if cluster.device.device_class is DeviceClass.CPU:  # gloo: shardline issues every collective as an all-reduce
        factor = 2.0
    return factor * coll.nbytes * (n - 1) / n / cluster.bus_bytes_per_s(n, coll.stride)


def predict(
    arch: Architecture,
    *,
    cluster: Cluster,
    training: Training,
    candidate: Candidate,
    memory: MemoryBreakdown | None = None,
) -> Prediction:
    """Predict one step of ``candidate`` (and its memory, from the estimator unless given)."""
    c = candidate
    device = cluster.device
    eff = device.efficiency
    world = cluster.world_size
    accum = accumulation_steps(cluster, training, c.micro_batch)
    if c.strategy.policy.hybrid:
        shard = c.shard_size or cluster.gpus_per_node
        if shard < 1 or world % shard:
            raise ConfigurationError(f"hybrid shard size {shard} must divide the world size {world}")
        c = dataclasses.replace(c, shard_size=shard)
    tokens_mb = c.micro_batch * training.seq_len
    rate = device.peak_tflops * 1e12 * eff.compute
    forward = tokens_mb * arch.forward_flops(training.seq_len) / rate
    backward = 2 * forward
    recompute = tokens_mb * arch.recompute_flops(training.seq_len, c.ac) / rate

    colls = _collectives(arch, cluster, training, c)
    timed = [(coll, _seconds(coll, cluster)) for coll in colls]

    def phase(name: str) -> tuple[float, float]:
        total = sum(t for coll, t in timed if coll.phase == name)
        edge = sum(t * coll.edge for coll, t in timed if coll.phase == name)
        return total, edge

    fwd_comm, fwd_edge = phase("forward")
    bwd_comm, bwd_edge = phase("backward")

    def forward_time(comm: float, edge: float) -> float:
        if not eff.overlap:
            return forward + comm
        return edge + max(forward, comm - edge)

    if eff.overlap:
        backward_time = max(backward + recompute, bwd_comm - bwd_edge) + bwd_edge
    else:
        backward_time = backward + recompute + bwd_comm
    forward_each = forward_time(fwd_comm, fwd_edge)
    knobs = c.strategy.policy
    shard = (c.shard_size or world) if knobs.hybrid else world
    local_params = arch.num_params / (shard if knobs.shard_optimizer else 1)
    optimizer = local_params * ADAMW_BYTES_PER_PARAM / (device.memory_gbps * 1e9 / 8 * eff.memory)
    engine_memory = 0.0
    if device.host_memory_gbps is not None:  # measured on CPU: the engine's copies take turns with compute
        traffic = host_traffic(
            arch, policy=knobs, world=world, shard=shard, reshard_after_forward=c.reshard_after_forward,
            param_bytes=training.param_dtype.itemsize, reduce_bytes=training.reduce_dtype.itemsize, accum=accum,
        )  # fmt: skip
        copy_gbps, fill_gbps, first_touch_gbps = device.host_memory_gbps
        engine_memory = traffic.seconds(copy_gbps=copy_gbps, fill_gbps=fill_gbps, first_touch_gbps=first_touch_gbps)
    step = accum * (forward_each + backward_time) + optimizer + engine_memory

    if memory is None:
        memory = plan_memory(
            arch,
            strategy=c.strategy,
            world_size=world,
            micro_batch=c.micro_batch,
            seq_len=training.seq_len,
            ac=c.ac,
            shard_size=c.shard_size if knobs.hybrid else None,
            reshard_after_forward=c.reshard_after_forward,
            param_dtype=training.param_dtype,
            reduce_dtype=training.reduce_dtype,
            in_place_gathers=device.device_class is DeviceClass.CPU,
        )
    compute = accum * (forward + backward)
    recompute_total = accum * recompute
    tokens_per_s = training.global_batch * training.seq_len / world / step
    peak_gib = memory.peak / 2**30
    return Prediction(
        candidate=c,
        step_time_s=step,
        tokens_per_s_per_gpu=tokens_per_s,
        mfu=tokens_per_s * arch.model_flops(training.seq_len) / (device.peak_tflops * 1e12),
        tflops_per_gpu=tokens_per_s
        * (arch.model_flops(training.seq_len) + arch.recompute_flops(training.seq_len, c.ac))
        / 1e12,
        peak_memory_gib=peak_gib,
        fits=peak_gib <= device.memory_gib * USABLE_MEMORY_FRACTION,
        compute_s=compute,
        recompute_s=recompute_total,
        exposed_comm_s=max(0.0, step - compute - recompute_total - optimizer - engine_memory),
        comm_s=sum(t for _, t in timed) * accum,
        optimizer_s=optimizer,
        grad_accum=accum,
        memory=memory,
        engine_memory_s=engine_memory,
    )
