"""``shardline plan``: predicted step time, tokens/s, MFU and memory of each way to train a model on a cluster.

The model is an HF ``config.json`` (``--hf-config``) or the ``shardline train`` config selected by
overrides (its GPT); the cluster is a known ``--gpu`` (or ``--peak-tflops``/``--memory-gib``), or this
machine measured by ``--calibrate`` (or a saved ``--calibration``). With ``--strategy``,
``--micro-batch`` and ``--ac`` all given it predicts that one configuration; otherwise it searches
(restricted to those given) and ranks what fits. Errors are one line; exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from shardline.errors import ShardlineError

if TYPE_CHECKING:
    from shardline.diagnostics.plan import Architecture, Cluster, Prediction
    from shardline.diagnostics.plan.finetune import FineTunePlan
    from shardline.train.schema import TrainConfig

__all__ = ["register"]

_EXAMPLES = """\
examples:
  shardline plan --hf-config llama3-8b/config.json --gpu H100-SXM --nodes 2 --seq-len 8192 --global-batch 32
  shardline plan --hf-config config.json --gpu A100-80GB --nodes 16 --seq-len 2048 --global-batch 256 \\
      --strategy full_shard --micro-batch 2 --ac full --json
  shardline plan model.dim=1024 model.n_layers=8 model.n_heads=16 --seq-len 128 --calibrate \\
      --save-calibration cal.json --precision fp32 --global-batch 4
  shardline plan --hf-config llama2-70b/config.json --gpu RTX-4090 --gpus-per-node 2 --seq-len 2048 \\
      --lora-rank 64 --quantize nf4 --offload      # QLoRA: which micro-batches fit, host RAM, step time
"""

_FINETUNE_FLAGS = ("lora_targets", "quantize", "offload", "host_link_gbps")

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _architecture(args: argparse.Namespace) -> tuple[Architecture, TrainConfig | None]:
    from shardline.diagnostics.plan import from_gpt_config, load_hf_config
    from shardline.errors import ConfigurationError

    if args.hf_config:
        if args.overrides:
            raise ConfigurationError(f"give --hf-config or model overrides, not both (got {args.overrides})")
        return load_hf_config(args.hf_config), None
    from shardline.models.gpt import GPT
    from shardline.train.build import build_model
    from shardline.train.config import compose_config, to_train_config

    cfg = to_train_config(compose_config(args.overrides))
    model = build_model(cfg, device="meta")
    if not isinstance(model, GPT):
        raise ConfigurationError(
            f"the train config's model is a {type(model).__name__}; shardline plan reads shardline's GPT from "
            "overrides, anything else from its HF config.json (--hf-config PATH)"
        )
    return from_gpt_config(model.config, name=f"GPT dim={model.config.dim} x {model.config.n_layers}"), cfg


def _cluster(args: argparse.Namespace) -> Cluster:
    from shardline.diagnostics.plan import Cluster, calibrate, custom_device, get_device, load_calibration
    from shardline.errors import ConfigurationError

    gpus_per_node = args.gpus_per_node
    if args.calibrate or args.calibration:
        if args.gpu or args.peak_tflops or args.memory_gib:
            raise ConfigurationError("--calibrate/--calibration measure the device; leave out --gpu/--peak-tflops")
        if args.calibrate:
            print(f"measuring this machine with {gpus_per_node or 2} gloo ranks ...", file=sys.stderr, flush=True)
            cal = calibrate(ranks=gpus_per_node or 2)
            if args.save_calibration:
                cal.save(args.save_calibration)
        else:
            cal = load_calibration(args.calibration)
        print(
            f"this machine: matmul {cal.matmul_gflops:.1f} GFLOP/s; gloo bus bandwidth: all-reduce "
            f"{cal.all_reduce_gbps:.2f}, all-gather {cal.all_gather_gbps:.2f}, reduce-scatter "
            f"{cal.reduce_scatter_gbps:.2f} Gb/s; AdamW {cal.optimizer_gbps:.2f} Gb/s per rank"
            + (
                f"; copy {cal.copy_gbps:.1f}, fill {cal.fill_gbps:.1f}, first touch {cal.first_touch_gbps:.1f} Gb/s"
                if cal.host_memory_gbps is not None
                else ""
            ),
            file=sys.stderr,
        )
        device, gpus_per_node = cal.device(), cal.ranks
    elif args.gpu:
        if args.peak_tflops or args.memory_gib:
            raise ConfigurationError("give --gpu or --peak-tflops with --memory-gib, not both")
        device = get_device(args.gpu)
    elif args.peak_tflops or args.memory_gib:
        if not (args.peak_tflops and args.memory_gib):
            raise ConfigurationError("--peak-tflops and --memory-gib go together (or name the device with --gpu)")
        device = custom_device(peak_tflops=args.peak_tflops, memory_gib=args.memory_gib)
    else:
        raise ConfigurationError("no device: name one with --gpu (e.g. H100-SXM), or --peak-tflops and --memory-gib")
    return Cluster(
        device=device,
        nodes=args.nodes,
        gpus_per_node=gpus_per_node or 8,
        intra_node_gbps=args.intra_node_gbps,
        inter_node_gbps=args.inter_node_gbps,
    )


def _raf(text: str | None) -> bool | int | None:
    if text is None:
        return None
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    try:
        return int(low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--reshard-after-forward {text!r}: use true, false or a group size") from None


def run(args: argparse.Namespace) -> tuple[list[Prediction], Cluster, str]:
    """The predictions the arguments ask for, the cluster, and a title."""
    from shardline.diagnostics.plan import ActivationCheckpointing, Candidate, Training, predict, search
    from shardline.engine import ShardingStrategy
    from shardline.errors import ConfigurationError

    arch, train_cfg = _architecture(args)
    cluster = _cluster(args)
    seq_len = args.seq_len or (train_cfg.data.seq_len if train_cfg is not None else None)
    if not seq_len:
        raise ConfigurationError("no sequence length: give --seq-len (e.g. --seq-len 4096)")
    training = Training(
        seq_len=seq_len,
        global_batch=args.global_batch or cluster.world_size,
        param_dtype=_DTYPES[args.precision],
        reduce_dtype=_DTYPES[args.reduce_dtype],
    )
    strategy = ShardingStrategy.parse(args.strategy) if args.strategy else None
    ac = ActivationCheckpointing.parse(args.ac) if args.ac else None
    title = f"{arch.name}: {arch.num_params / 1e9:.3g}B parameters, seq {seq_len}, global batch {training.global_batch}"
    if strategy is not None and args.micro_batch and ac is not None:
        candidate = Candidate(strategy=strategy, micro_batch=args.micro_batch, ac=ac, shard_size=args.shard_size,
                              reshard_after_forward=args.reshard_after_forward)  # fmt: skip
        return [predict(arch, cluster=cluster, training=training, candidate=candidate)], cluster, title
    if args.shard_size is not None or args.reshard_after_forward is not None:
        raise ConfigurationError(
            "--shard-size and --reshard-after-forward describe one configuration: give them with --strategy, "
            "--micro-batch and --ac (the search tries hybrid shard sizes and resharding itself)"
        )
    found = search(
        arch,
        cluster=cluster,
        training=training,
        strategies=(strategy,) if strategy else (),
        micro_batches=(args.micro_batch,) if args.micro_batch else (),
        acs=(ac,) if ac else (),
    )
    return found[: args.top], cluster, title


def _finetune(args: argparse.Namespace) -> tuple[list[FineTunePlan], Cluster, str]:
    """``--lora-rank``: the fine-tune plan for each micro-batch asked (default 1, 2, 4, 8, 16)."""
    from shardline.diagnostics.plan import ActivationCheckpointing, Training
    from shardline.diagnostics.plan.finetune import DEFAULT_HOST_LINK_GBPS, FineTune, parse_base_bits, plan_finetune
    from shardline.engine import ShardingStrategy
    from shardline.errors import ConfigurationError

    if args.strategy and ShardingStrategy.parse(args.strategy) is not ShardingStrategy.FULL_SHARD:
        raise ConfigurationError(f"--lora-rank plans a FULL_SHARD fine-tune; leave out --strategy {args.strategy}")
    arch, train_cfg = _architecture(args)
    cluster = _cluster(args)
    seq_len = args.seq_len or (train_cfg.data.seq_len if train_cfg is not None else None)
    if not seq_len:
        raise ConfigurationError("no sequence length: give --seq-len (e.g. --seq-len 2048)")
    bits = parse_base_bits(args.quantize or "none")
    finetune = FineTune(lora_rank=args.lora_rank, lora_targets=args.lora_targets or "all-linear", base_bits=bits,
                        offload=args.offload, host_link_gbps=args.host_link_gbps or DEFAULT_HOST_LINK_GBPS)  # fmt: skip
    ac = ActivationCheckpointing.parse(args.ac or "full")
    plans = []
    for mb in (args.micro_batch,) if args.micro_batch else (1, 2, 4, 8, 16):
        training = Training(seq_len=seq_len, global_batch=args.global_batch or mb * cluster.world_size,
                            param_dtype=_DTYPES[args.precision], reduce_dtype=_DTYPES[args.reduce_dtype])  # fmt: skip
        plans.append(plan_finetune(arch, cluster=cluster, training=training, micro_batch=mb, finetune=finetune, ac=ac))
    base = "bf16" if bits == 16 else f"{bits:.3f}-bit"
    title = (
        f"{arch.name}: {arch.num_params / 1e9:.3g}B parameters ({base} base), LoRA r={args.lora_rank} "
        f"({plans[0].trainable_params / 1e6:,.1f}M trainable), seq {seq_len}, AC {ac.value}"
        + (f", offload at {finetune.host_link_gbps:g} Gb/s" if args.offload else "")
    )
    return plans, cluster, title


def _print_finetune(plans: Sequence[FineTunePlan], cluster: Cluster, title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    device = cluster.device
    table = Table(title=f"{title}\n{cluster.nodes} x {cluster.gpus_per_node} {device.name} ({device.memory_gib:g} GiB)",
                  title_justify="left")  # fmt: skip
    for column in ("micro-batch", "fits", "device GiB", "host GiB/rank", "host GiB/node", "step s", "tokens/s/GPU",
                   "compute s", "transfers s", "host copies s"):  # fmt: skip
        table.add_column(column, justify="right")
    gib = 2**30
    for p in plans:
        table.add_row(str(p.micro_batch), "yes" if p.fits else "no", f"{p.device_bytes / gib:.1f}",
                      f"{p.host_bytes / gib:.1f}", f"{p.host_bytes_per_node / gib:.1f}", f"{p.step_time_s:.2f}",
                      f"{p.tokens_per_s_per_gpu:,.0f}", f"{p.compute_s:.2f}", f"{p.transfer_s:.2f}",
                      f"{p.copy_s:.2f}")  # fmt: skip
    Console(highlight=False, soft_wrap=True, width=200).print(table)


def _print_table(predictions: Sequence[Prediction], cluster: Cluster, title: str) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from shardline.diagnostics.plan.render import HEADER, table_rows

    device = cluster.device
    table = Table(
        title=f"{title}\n{cluster.nodes} x {cluster.gpus_per_node} {device.name} "
        f"({device.peak_tflops:g} TFLOP/s, {device.memory_gib:g} GiB); time split in s per step",
        title_justify="left",
    )
    for column in HEADER:
        table.add_column(column, justify="left" if column == "configuration" else "right")
    for row in table_rows(predictions):
        table.add_row(*(escape(cell) for cell in row))
    Console(highlight=False, soft_wrap=True, width=200).print(table)


def _cmd_plan(args: argparse.Namespace) -> int:
    if args.lora_rank is not None:
        return _cmd_finetune(args)
    given = [f"--{name.replace('_', '-')}" for name in _FINETUNE_FLAGS if getattr(args, name)]
    if given:
        print(f"error: {', '.join(given)} describe a LoRA fine-tune: give --lora-rank too (e.g. --lora-rank 16)",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        predictions, cluster, title = run(args)
        if args.plot:
            from shardline.diagnostics.plan.render import plot_predictions

            plot_predictions(predictions, cluster=cluster, title=title, path=args.plot)
    except ShardlineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([p.as_dict() for p in predictions], indent=2))
    else:
        _print_table(predictions, cluster, title)
    return 0


def _cmd_finetune(args: argparse.Namespace) -> int:
    try:
        plans, cluster, title = _finetune(args)
    except ShardlineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([p.as_dict() for p in plans], indent=2))
    else:
        _print_finetune(plans, cluster, title)
    return 0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``plan`` to the ``shardline`` command."""
    parser = subparsers.add_parser(
        "plan",
        help="predict step time, tokens/s, MFU and memory per strategy for a model on a cluster",
        description="Predict each way to train a decoder on a cluster (ZeRO-0..3, hybrid shard sizes, "
        "reshard_after_forward, micro-batch, activation checkpointing): memory from the estimator, time from "
        "FLOPs, bytes and rates; keep what fits and rank by tokens/s. See docs/planning.md.",
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="shardline train overrides (its GPT)")
    parser.add_argument("--hf-config", metavar="PATH", help="an HF config.json: Llama, Mistral, Qwen2, GPT-2, GPT-NeoX")
    parser.add_argument(
        "--gpu",
        help="a known device: A100-40GB, A100-80GB, H100-SXM, H100-PCIe, H100-96GB, H200, L4, RTX-3090, RTX-4090",
    )
    parser.add_argument("--peak-tflops", type=float, help="or describe it: dense bf16 peak, TFLOP/s")
    parser.add_argument("--memory-gib", type=float, help="and its memory, GiB")
    parser.add_argument("--nodes", type=int, default=1, help="machines (default 1)")
    parser.add_argument("--gpus-per-node", type=int, help="devices per machine (default 8; calibrated: its ranks)")
    parser.add_argument("--intra-node-gbps", type=float, help="link between a node's devices, Gb/s per device")
    parser.add_argument("--inter-node-gbps", type=float, help="network across nodes, Gb/s per device")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (default: the train config's)")
    parser.add_argument("--global-batch", type=int, help="sequences per step over all ranks (default: 1 per rank)")
    parser.add_argument("--precision", choices=sorted(_DTYPES), default="bf16", help="parameter/compute dtype")
    parser.add_argument("--reduce-dtype", choices=sorted(_DTYPES), default="fp32", help="gradient reduction dtype")
    parser.add_argument(
        "--strategy",
        help="predict (or search) only this sharding strategy: full_shard/fsdp/zero3, shard_grad_op/zero2, "
        "shard_opt/zero1, no_shard/ddp, hybrid_shard/hsdp, hybrid_shard_zero2/hsdp_zero2",
    )
    parser.add_argument("--micro-batch", type=int, help="only this micro-batch (sequences per rank per pass)")
    parser.add_argument("--ac", choices=["none", "selective", "full"], help="only this activation checkpointing")
    parser.add_argument("--shard-size", type=int, help="hybrid strategies: ranks per shard group")
    parser.add_argument("--reshard-after-forward", type=_raf, metavar="true|false|N", help="as wrap() takes it")
    parser.add_argument("--calibrate", action="store_true", help="measure this machine (gloo ranks) as the device")
    parser.add_argument("--save-calibration", metavar="FILE", help="with --calibrate: save the measurement as JSON")
    parser.add_argument("--calibration", metavar="FILE", help="use a measurement saved by --save-calibration")
    parser.add_argument("--top", type=int, default=10, help="rows of the ranking shown (default 10)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--plot", metavar="PNG", help="also draw the time split of each configuration")
    tune = parser.add_argument_group("fine-tuning on small GPUs (docs/planning.md)")
    tune.add_argument("--lora-rank", type=int, help="plan a LoRA fine-tune with adapters of this rank")
    tune.add_argument("--lora-targets", help="adapted layers: all-linear (default) or e.g. q_proj,v_proj")
    tune.add_argument("--quantize", help="frozen base: none (bf16, default), nf4 (4.127 bits), or bits per weight")
    tune.add_argument("--offload", action="store_true", help="sharded parameters and optimizer state in host RAM")
    tune.add_argument("--host-link-gbps", type=float, help="host <-> device copies, Gb/s per device (default 200)")
    parser.set_defaults(func=_cmd_plan, positionals_into="overrides")
