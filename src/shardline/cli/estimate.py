"""``shardline estimate``: predicted per-rank memory for a training config, before running it."""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from shardline.diagnostics.estimate import MemoryEstimate, estimate_memory
from shardline.engine import ShardingStrategy, hybrid_degrees
from shardline.errors import ShardlineError
from shardline.train.build import build_model, build_policies
from shardline.train.config import compose_config, resolve_accelerator, to_train_config

if TYPE_CHECKING:
    from shardline.diagnostics.plan.finetune import FineTuneMemory

__all__ = ["finetune", "register", "run"]

_ROWS = (
    ("sharded_params", "parameters (this rank's masters, fp32)"),
    ("sharded_grads", "gradients (reduced, fp32)"),
    ("optimizer_state", "optimizer state (AdamW moments + step)"),
    ("unsharded_params", "gathered parameters (peak)"),
    ("unsharded_grads", "full gradients before reduction (peak)"),
    ("comm_buffers", "communication buffers (peak)"),
    ("activations", "activations (one micro-batch)"),
)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f} MiB"


def run(overrides: Sequence[str], *, world_size: int | None = None) -> MemoryEstimate:
    """Estimate for the ``shardline train`` config selected by ``overrides`` (Hydra syntax)."""
    cfg = to_train_config(compose_config(overrides))
    policies = build_policies(cfg)
    strategy = cfg.trainer.strategy.sharding
    world = world_size or cfg.trainer.devices * cfg.trainer.num_nodes
    if strategy is None:  # single device: the model is not wrapped; one rank holds everything
        strategy, world = ShardingStrategy.NO_SHARD, 1
    shard_size = cfg.trainer.strategy.shard_size
    replicate_size = cfg.trainer.strategy.replicate_size
    if strategy.policy.hybrid:
        # --world-size rescales the job: keep the shard group (one node), grow the replicas.
        shard_size = hybrid_degrees(world_size=world, replicate_size=-1 if world_size else replicate_size,
                                    shard_size=shard_size)[1]  # fmt: skip
    return estimate_memory(
        lambda: build_model(cfg, device="cpu"),
        policy=policies.wrap,
        strategy=strategy,
        world_size=world,
        micro_batch_size=cfg.trainer.micro_batch_size,
        seq_len=cfg.data.seq_len,
        mixed_precision=policies.mixed_precision,
        checkpointing_policy=policies.checkpointing,
        shard_size=shard_size,
        reshard_after_forward=cfg.trainer.strategy.reshard_after_forward,
        in_place_gathers=resolve_accelerator(cfg.trainer.accelerator) == "cpu",  # gloo
    )


def render(est: MemoryEstimate, console: Console) -> None:
    """Print the estimate as two tables: memory by component, and the units."""
    mesh = f" ({est.replicate_size} replicas x {est.shard_size}-rank shard groups)" if "hybrid" in est.strategy else ""
    table = Table(
        title=f"Estimated memory per rank: {est.strategy}, {est.world_size} ranks{mesh}, {est.parameters:,} parameters",
        title_justify="left",
    )
    table.add_column("component")
    table.add_column("bytes", justify="right")
    table.add_column("share of peak", justify="right")
    for key, label in _ROWS:
        value = getattr(est, key)
        table.add_row(label, _mib(value), f"{value / est.peak:.0%}" if est.peak else "-")
    table.add_row("[bold]held between steps[/]", _mib(est.steady), f"{est.steady / est.peak:.0%}" if est.peak else "-")
    table.add_row("[bold]peak during a step[/]", _mib(est.peak), "100%")
    console.print(table)
    units = Table(title="units (rank 0)", title_justify="left")
    for column in ("unit", "parameters", "shard elements", "gathered elements"):
        units.add_column(column, justify="left" if column == "unit" else "right")
    for u in est.units:
        units.add_row(escape(u.name), f"{u.numel:,}", f"{u.shard_numel:,}", f"{u.unsharded_numel:,}")
    console.print(units)


def finetune(
    overrides: Sequence[str], *, lora_rank: int, lora_targets: str, quantize: str, offload: bool,
    world_size: int | None = None,
) -> FineTuneMemory:  # fmt: skip
    """``--lora-rank``: one rank's memory for a LoRA / QLoRA fine-tune of the config's GPT (docs/planning.md)."""
    from shardline.diagnostics.plan import ActivationCheckpointing, from_gpt_config
    from shardline.diagnostics.plan.finetune import FineTune, finetune_memory, parse_base_bits
    from shardline.errors import ConfigurationError
    from shardline.models.gpt import GPT

    cfg = to_train_config(compose_config(overrides))
    model = build_model(cfg, device="meta")
    if not isinstance(model, GPT):
        raise ConfigurationError(
            f"--lora-rank estimates shardline's GPT; the config's model is a {type(model).__name__} (for an HF "
            "model use shardline plan --hf-config PATH --lora-rank R)"
        )
    checkpointing = build_policies(cfg).checkpointing is not None
    return finetune_memory(
        from_gpt_config(model.config, name="GPT"),
        world_size=world_size or cfg.trainer.devices * cfg.trainer.num_nodes,
        micro_batch=cfg.trainer.micro_batch_size,
        seq_len=cfg.data.seq_len,
        finetune=FineTune(
            lora_rank=lora_rank, lora_targets=lora_targets, base_bits=parse_base_bits(quantize), offload=offload
        ),
        ac=ActivationCheckpointing.FULL if checkpointing else ActivationCheckpointing.NONE,
    )


def _render_finetune(mem: FineTuneMemory, console: Console) -> None:
    table = Table(title=f"Estimated memory per rank: LoRA fine-tune, {mem.trainable_params:,} trainable parameters",
                  title_justify="left")  # fmt: skip
    table.add_column("component")
    table.add_column("bytes", justify="right")
    table.add_column("where", justify="right")
    sharded_at = "host" if mem.offload else "device"
    for label, value, where in (
        ("frozen base (this rank's shard)", mem.frozen_shard, sharded_at),
        ("adapters: fp32 master, gradient, AdamW state", mem.adapter_states, sharded_at),
        ("gathered units and dequantized weight (peak)", mem.gathered, "device"),
        ("activations (one micro-batch)", mem.activations, "device"),
    ):
        table.add_row(label, _mib(value), where)
    table.add_row("[bold]peak on the device[/]", _mib(mem.device_bytes), "device")
    table.add_row("[bold]host memory[/]", _mib(mem.host_bytes), "host")
    console.print(table)


def _cmd_estimate(args: argparse.Namespace) -> int:
    console = Console(highlight=False, soft_wrap=True)
    if args.lora_rank is None and (args.lora_targets or args.quantize or args.offload):
        Console(stderr=True, highlight=False, soft_wrap=True).print(
            "[bold red]error:[/] --lora-targets, --quantize and --offload describe a LoRA fine-tune: give --lora-rank "
            "too (e.g. --lora-rank 16)"
        )
        return 2
    if args.lora_rank is not None:
        try:
            mem = finetune(
                args.overrides,
                lora_rank=args.lora_rank,
                lora_targets=args.lora_targets or "all-linear",
                quantize=args.quantize or "none",
                offload=args.offload,
                world_size=args.world_size,
            )
        except ShardlineError as exc:
            Console(stderr=True, highlight=False, soft_wrap=True).print("[bold red]error:[/]", escape(str(exc)))
            return 2
        if args.json:
            print(json.dumps({**dataclasses.asdict(mem), "device_bytes": mem.device_bytes,
                              "host_bytes": mem.host_bytes}, indent=2))  # fmt: skip
        else:
            _render_finetune(mem, console)
        return 0
    try:
        est = run(args.overrides, world_size=args.world_size)
    except ShardlineError as exc:
        Console(stderr=True, highlight=False, soft_wrap=True).print("[bold red]error:[/]", escape(str(exc)))
        return 2
    if args.json:
        print(json.dumps(est.as_dict(), indent=2, default=lambda o: o.__dict__))
    else:
        render(est, console)
    return 0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``estimate`` to the ``shardline`` command."""
    parser = subparsers.add_parser(
        "estimate",
        help="predict per-rank memory for a training config (no memory used)",
        description="Predict per-rank memory by component for the config `shardline train` would run "
        "(same overrides), from the ZeRO formulas on the real unit layout and a dry run on fake tensors.",
    )
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="the same overrides as shardline train")
    parser.add_argument("--world-size", type=int, help="ranks to estimate for (default: devices x num_nodes)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--lora-rank", type=int, help="a LoRA fine-tune with adapters of this rank (docs/planning.md)")
    parser.add_argument("--lora-targets", help="adapted layers: all-linear (default) or e.g. q_proj,v_proj")
    parser.add_argument("--quantize", help="frozen base: none (bf16, default), nf4 (4.127 bits), or bits per weight")
    parser.add_argument("--offload", action="store_true", help="sharded parameters and optimizer state in host RAM")
    parser.set_defaults(func=_cmd_estimate, positionals_into="overrides")
