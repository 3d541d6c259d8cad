"""``shardline estimate``: predicted per-rank memory for a training config, before running it."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from shardline.diagnostics.estimate import MemoryEstimate, estimate_memory
from shardline.engine import ShardingStrategy, hybrid_degrees
from shardline.errors import ShardlineError
from shardline.train.build import build_model, build_policies
from shardline.train.config import compose_config, resolve_accelerator, to_train_config

__all__ = ["register", "run"]

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


def _cmd_estimate(args: argparse.Namespace) -> int:
    console = Console(highlight=False, soft_wrap=True)
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
    parser.set_defaults(func=_cmd_estimate, positionals_into="overrides")
