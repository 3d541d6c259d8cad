"""Fine-tuning on small GPUs: a 4-bit (NF4) frozen base, LoRA adapters, and CPU offload, planned.

A fine-tune trains adapters beside a frozen base. Per rank, with ``W`` ranks sharding everything
(FULL_SHARD):

* **frozen base**: the blocks' linear weights at ``base_bits`` per weight (16 for bf16 LoRA,
  :func:`nf4_bits_per_param` for QLoRA; below 16 bits they are the ``quantized_shard`` part, the
  engine's ``memory_stats().quantized_params``), every other frozen parameter (embeddings, output
  head, norms) in bf16; sharded, ``1/W`` each. The engine gives each rank whole scaler groups of
  each 4-bit weight, so it holds up to one group (and 16-byte alignment of three parts) more per
  weight than ``1/W``: kilobytes, left out;
* **adapters**: ``T`` trainable parameters (:func:`lora_params`), each holding an fp32 master (4 B),
  its reduced gradient (4 B) and AdamW's two moments (8 B), sharded, plus AdamW's 4-byte step per
  adapter tensor -- the optimizer state exists for these only;
* **gathered, during the step**: the root unit (embeddings, head, final norm, bf16) and two blocks
  (the one computing and the one prefetched) as stored, plus one bf16 copy of the largest linear
  weight while a quantized layer dequantizes it for its matmul;
* **activations**: the estimator's (:func:`~.memory.plan_memory`) for the same model and
  checkpointing. With adapters on a linear layer, backward needs that layer's input for the
  adapter's gradient -- the tensor a full fine-tune saves for the weight's -- so a LoRA step saves
  what a full fine-tune saves (plus the rank-``r`` intermediates, negligible).

With ``offload``, the sharded part (frozen shards, adapter masters, gradients, optimizer state)
lives in host memory, reported apart (per rank and per node); the device keeps the gathered units
and the activations. Each gather then first copies the unit's shard -- frozen part and adapters'
fp32 masters -- to the device, and each reduction copies the adapters' gradient shard back, over
the host link (``host_link_gbps``). Per micro-batch the root unit is gathered (and copied) once,
as it stays gathered from forward into backward, and so is the block that runs last; every other
block twice: ``root + (2L - 1) * block`` bytes to the device (the engine's ``transfer_stats``).

Time per micro-batch: forward at the device's achieved rate (as :mod:`.cost`); backward *once*
the forward -- the frozen weights need no weight gradient, only the input's (the adapters' weight
gradients are ``r/dim`` of a layer's work) -- plus what checkpointing recomputes. Transfers: the
frozen base all-gathered twice (forward, and again in backward: ZeRO-3 frees it after forward),
the adapters' gradients reduce-scattered, and under offload the copies above. On a GPU the
transfers run beside compute (prefetch one unit ahead), so a micro-batch takes the longer of the
two; a CPU adds them. Dequantization is not charged.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from typing import Any

import torch

from shardline.diagnostics.plan.architecture import ActivationCheckpointing, Architecture
from shardline.diagnostics.plan.cost import USABLE_MEMORY_FRACTION, Cluster, Training, accumulation_steps
from shardline.diagnostics.plan.memory import plan_memory
from shardline.engine import ShardingStrategy
from shardline.errors import ConfigurationError

__all__ = [
    "ALL_LINEAR",
    "DEFAULT_HOST_LINK_GBPS",
    "FineTune",
    "FineTuneMemory",
    "FineTunePlan",
    "finetune_memory",
    "lora_params",
    "nf4_bits_per_param",
    "parse_base_bits",
    "parse_targets",
    "plan_finetune",
]

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The linear layers of a decoder block, by their Hugging Face (Llama) names."""
DEFAULT_HOST_LINK_GBPS = 200.0
"""Host <-> device copies, Gb/s per device and direction: PCIe 4.0 x16 (32 GB/s) at about 80%."""
_ADAM_STATE_BYTES = 16  # fp32 master, fp32 gradient, two fp32 moments
_BF16 = 2


def nf4_bits_per_param(*, block: int = 64, double_quant: bool = True, scale_block: int = 256) -> float:
    """Bits per weight of NF4 storage: 4-bit codes plus the block scales.

    Each ``block`` of weights shares one absmax scale: an fp32 (32 bits) one, or with double
    quantization an 8-bit one, whose own ``scale_block`` scales share one fp32 scale. Defaults
    (bitsandbytes' QLoRA): ``4 + 8/64 + 32/(64*256) = 4.127`` bits; without double quantization 4.5.
    """
    if block < 1 or scale_block < 1:
        raise ConfigurationError(f"NF4 block sizes must be >= 1, got block={block}, scale_block={scale_block}")
    if double_quant:
        return 4 + 8 / block + 32 / (block * scale_block)
    return 4 + 32 / block


def _linear_shapes(arch: Architecture) -> dict[str, tuple[int, int]]:
    """(in, out) features of each linear layer of one block, by Hugging Face name."""
    shapes = {
        "q_proj": (arch.dim, arch.dim),
        "k_proj": (arch.dim, arch.kv_dim),
        "v_proj": (arch.dim, arch.kv_dim),
        "o_proj": (arch.dim, arch.dim),
        "up_proj": (arch.dim, arch.ffn_dim),
        "down_proj": (arch.ffn_dim, arch.dim),
    }
    if arch.gated_mlp:
        shapes["gate_proj"] = (arch.dim, arch.ffn_dim)
    return shapes


def parse_targets(arch: Architecture, targets: str | Iterable[str]) -> tuple[str, ...]:
    """``"all-linear"``, or names like ``q_proj,v_proj`` (also ``q``, ``v``): the block's linear layers meant.

    Raises:
        ConfigurationError: a name that is not a linear layer of ``arch``'s blocks, naming those.
    """
    shapes = _linear_shapes(arch)
    names = [t.strip() for t in (targets.split(",") if isinstance(targets, str) else targets) if t.strip()]
    if names in (["all-linear"], ["all"]):
        return tuple(n for n in ALL_LINEAR if n in shapes)
    out = []
    for name in names:
        full = name if name.endswith("_proj") else f"{name}_proj"
        if full not in shapes:
            raise ConfigurationError(
                f"LoRA target {name!r} is not a linear layer of {arch.name}'s blocks; use all-linear or some of "
                f"{', '.join(shapes)}"
            )
        if full not in out:
            out.append(full)
    if not out:
        raise ConfigurationError(f"no LoRA targets given; use all-linear or some of {', '.join(shapes)}")
    return tuple(out)


def lora_params(arch: Architecture, *, rank: int, targets: str | Iterable[str]) -> int:
    """Trainable adapter parameters: ``rank * (in + out)`` (matrices A and B) per targeted layer per block."""
    if rank < 1:
        raise ConfigurationError(f"LoRA rank must be >= 1, got {rank}")
    shapes = _linear_shapes(arch)
    return arch.n_layers * sum(rank * sum(shapes[n]) for n in parse_targets(arch, targets))


@dataclasses.dataclass(frozen=True, kw_only=True)
class FineTune:
    """A parameter-efficient fine-tune: what the base is stored as, the adapters, offload.

    Attributes:
        lora_rank: Rank of the adapters.
        lora_targets: ``"all-linear"`` or the block's linear layers adapted (``q_proj,v_proj``).
        base_bits: Bits per frozen linear weight: 16 (bf16 LoRA) or :func:`nf4_bits_per_param` (QLoRA).
        offload: Keep the sharded part in host memory (device: gathered units and activations).
        host_link_gbps: Host <-> device bandwidth per device and direction, Gb/s.
    """

    lora_rank: int
    lora_targets: str = "all-linear"
    base_bits: float = 16.0
    offload: bool = False
    host_link_gbps: float = DEFAULT_HOST_LINK_GBPS

    def __post_init__(self) -> None:
        if self.lora_rank < 1:
            raise ConfigurationError(f"--lora-rank must be >= 1, got {self.lora_rank}")
        if not 0 < self.base_bits <= 32:
            raise ConfigurationError(f"base bits per weight must be in (0, 32], got {self.base_bits}")
        if not self.host_link_gbps > 0:
            raise ConfigurationError(f"--host-link-gbps must be > 0, got {self.host_link_gbps}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class FineTunePlan:
    """One rank's memory (bytes) and one step's time (seconds) for a :class:`FineTune`."""

    micro_batch: int
    grad_accum: int
    trainable_params: int
    frozen_shard: int
    quantized_shard: int
    adapter_states: int
    gathered: int
    activations: int
    device_bytes: int
    host_bytes: int
    host_bytes_per_node: int
    fits: bool
    compute_s: float
    transfer_s: float
    copy_s: float
    host_to_device_bytes: int
    device_to_host_bytes: int
    optimizer_s: float
    step_time_s: float
    tokens_per_s_per_gpu: float

    def as_dict(self) -> dict[str, Any]:
        """The ``--json`` record (memory in GiB)."""
        gib = 2**30
        return {
            "micro_batch": self.micro_batch,
            "grad_accum": self.grad_accum,
            "trainable_params": self.trainable_params,
            "fits": self.fits,
            "device_gib": self.device_bytes / gib,
            "host_gib_per_rank": self.host_bytes / gib,
            "host_gib_per_node": self.host_bytes_per_node / gib,
            "memory_gib": {
                "frozen_shard": self.frozen_shard / gib,
                "quantized_shard": self.quantized_shard / gib,
                "adapter_states": self.adapter_states / gib,
                "gathered": self.gathered / gib,
                "activations": self.activations / gib,
            },
            "step_time_s": self.step_time_s,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "time_split_s": {
                "compute": self.compute_s,
                "transfers": self.transfer_s,
                "host_copies": self.copy_s,
                "optimizer": self.optimizer_s,
            },
            "host_copy_bytes_per_micro_batch": {
                "host_to_device": self.host_to_device_bytes,
                "device_to_host": self.device_to_host_bytes,
            },
        }


def _frozen_bytes(arch: Architecture, base_bits: float) -> tuple[float, float]:
    """(the whole frozen base, one block) in bytes: linear weights at ``base_bits``, the rest in bf16."""
    linear = arch.attention_matmul_params + arch.mlp_matmul_params
    block = linear * base_bits / 8 + (arch.block_params - linear) * _BF16
    return arch.n_layers * block + arch.root_params * _BF16, block


def _quantized_bytes(arch: Architecture, base_bits: float) -> float:
    """Bytes of the blocks' linear weights when stored below 16 bits (the quantized part of the base), else 0."""
    if base_bits >= 16:
        return 0.0
    return arch.n_layers * (arch.attention_matmul_params + arch.mlp_matmul_params) * base_bits / 8


@dataclasses.dataclass(frozen=True, kw_only=True)
class FineTuneMemory:
    """One rank's bytes for a :class:`FineTune`: the components, and where they live."""

    trainable_params: int
    frozen_shard: int
    quantized_shard: int
    adapter_states: int
    gathered: int
    activations: int
    offload: bool

    @property
    def sharded(self) -> int:
        """Frozen shard and adapter state: on the host under offload, else on the device."""
        return self.frozen_shard + self.adapter_states

    @property
    def device_bytes(self) -> int:
        """Peak on the device during a step."""
        return self.gathered + self.activations + (0 if self.offload else self.sharded)

    @property
    def host_bytes(self) -> int:
        """Held in host memory (offload only)."""
        return self.sharded if self.offload else 0


def finetune_memory(
    arch: Architecture,
    *,
    world_size: int,
    micro_batch: int,
    seq_len: int,
    finetune: FineTune,
    ac: ActivationCheckpointing = ActivationCheckpointing.FULL,
    param_dtype: torch.dtype = torch.bfloat16,
    reduce_dtype: torch.dtype = torch.float32,
) -> FineTuneMemory:
    """One rank's memory for ``finetune`` of ``arch`` over ``world_size`` ranks (see the module docstring)."""
    if world_size < 1:
        raise ConfigurationError(f"world size must be >= 1, got {world_size}")
    trainable = lora_params(arch, rank=finetune.lora_rank, targets=finetune.lora_targets)
    tensors = 2 * len(parse_targets(arch, finetune.lora_targets)) * arch.n_layers  # A and B per adapted layer
    frozen, block = _frozen_bytes(arch, finetune.base_bits)
    adapter_block = trainable / arch.n_layers * _BF16
    largest = max(i * o for i, o in _linear_shapes(arch).values()) * _BF16 if finetune.base_bits < 16 else 0
    activations = plan_memory(
        arch, strategy=ShardingStrategy.FULL_SHARD, world_size=world_size, micro_batch=micro_batch,
        seq_len=seq_len, ac=ac, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
    ).activations  # fmt: skip
    return FineTuneMemory(
        trainable_params=trainable,
        frozen_shard=round(frozen / world_size),
        quantized_shard=round(_quantized_bytes(arch, finetune.base_bits) / world_size),
        adapter_states=round(trainable * _ADAM_STATE_BYTES / world_size) + 4 * tensors,
        gathered=round(arch.root_params * _BF16 + 2 * (block + adapter_block) + largest),
        activations=activations,
        offload=finetune.offload,
    )


def plan_finetune(
    arch: Architecture,
    *,
    cluster: Cluster,
    training: Training,
    micro_batch: int,
    finetune: FineTune,
    ac: ActivationCheckpointing = ActivationCheckpointing.FULL,
) -> FineTunePlan:
    """Memory and step time of ``finetune`` of ``arch`` on ``cluster`` (see the module docstring)."""
    world = cluster.world_size
    accum = accumulation_steps(cluster, training, micro_batch)
    device = cluster.device
    memory = finetune_memory(
        arch, world_size=world, micro_batch=micro_batch, seq_len=training.seq_len, finetune=finetune, ac=ac,
        param_dtype=training.param_dtype, reduce_dtype=training.reduce_dtype,
    )  # fmt: skip
    trainable, frozen_shard = memory.trainable_params, memory.frozen_shard
    frozen, block = _frozen_bytes(arch, finetune.base_bits)
    device_bytes, host_bytes = memory.device_bytes, memory.host_bytes

    eff = device.efficiency
    rate = device.peak_tflops * 1e12 * eff.compute
    tokens_mb = micro_batch * training.seq_len
    forward = tokens_mb * arch.forward_flops(training.seq_len) / rate
    compute = 2 * forward + tokens_mb * arch.recompute_flops(training.seq_len, ac) / rate
    ring = (world - 1) / world
    bus = cluster.bus_bytes_per_s(world)
    gathered_bytes = frozen + trainable * _BF16
    transfers = (2 * gathered_bytes + trainable * 4) * ring / bus if world > 1 else 0.0
    link = finetune.host_link_gbps * 1e9 / 8
    # Offload: each gather copies the unit's shard (frozen part, adapters' fp32 master) to the device first: the
    # root once per micro-batch, the last block once, the other blocks twice; the adapters' gradients come back.
    adapter_master_block = trainable / arch.n_layers * 4
    to_device = (arch.root_params * _BF16 + (2 * arch.n_layers - 1) * (block + adapter_master_block)) / world
    to_host = trainable * 4 / world
    if not finetune.offload:
        to_device = to_host = 0.0
    copies = (to_device + to_host) / link
    per_micro = max(compute, transfers + copies) if eff.overlap else compute + transfers + copies
    # AdamW streams 28 B per local adapter parameter: on the device, or over the host link when offloaded.
    optimizer_rate = link if finetune.offload else device.memory_gbps * 1e9 / 8 * eff.memory
    optimizer = trainable / world * 28 / optimizer_rate
    step = accum * per_micro + optimizer
    return FineTunePlan(
        micro_batch=micro_batch,
        grad_accum=accum,
        trainable_params=trainable,
        frozen_shard=frozen_shard,
        quantized_shard=memory.quantized_shard,
        adapter_states=memory.adapter_states,
        gathered=memory.gathered,
        activations=memory.activations,
        device_bytes=device_bytes,
        host_bytes=host_bytes,
        host_bytes_per_node=host_bytes * min(world, cluster.gpus_per_node),
        fits=device_bytes / 2**30 <= device.memory_gib * USABLE_MEMORY_FRACTION,
        compute_s=accum * compute,
        transfer_s=accum * transfers,
        copy_s=accum * copies,
        host_to_device_bytes=round(to_device),
        device_to_host_bytes=round(to_host),
        optimizer_s=optimizer,
        step_time_s=step,
        tokens_per_s_per_gpu=training.global_batch * training.seq_len / world / step,
    )


def parse_base_bits(text: str) -> float:
    """``--quantize``: ``none`` (bf16 base, 16 bits), ``nf4`` (4.127 bits), or a number of bits per weight."""
    low = text.strip().lower()
    if low in ("none", "bf16", "16"):
        return 16.0
    if low in ("nf4", "4bit", "qlora"):
        return nf4_bits_per_param()
    if re.fullmatch(r"\d+(\.\d+)?", low):
        return float(low)
    raise ConfigurationError(f"--quantize {text!r}: use none (bf16), nf4 (4-bit NF4 with double quantization), or bits")
