"""``shardline bench``: shardline's engine vs torch FSDP2 vs torch DDP vs one process.

``register(subparsers)`` adds the subcommand to the main parser (the benchmark itself is
:mod:`shardline.diagnostics.bench`). Exit codes: 0 done, 1 bad input (one line naming the value
and the fix), 2 usage errors (argparse).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import TYPE_CHECKING

from shardline.errors import ConfigurationError, ShardlineError

if TYPE_CHECKING:
    from shardline.diagnostics.bench.settings import ModelSize

__all__ = ["register"]

_EXAMPLES = """\
examples:
  shardline bench --out docs/benchmarks                     # default and 10x sizes, W=2, hybrid W=4, W=1
  shardline bench --out docs/benchmarks/101m --sizes 101m --micro-batch 2 --rounds 3 --steps 1 --warmup 1 \
      --no-w1 --configs shardline_full_shard,shardline_no_shard,shardline_shard_opt,torch_fsdp2,torch_ddp
  shardline bench --out /tmp/bench --sizes tiny --rounds 1 --steps 2   # a smoke run in seconds
"""


def _sizes(text: str) -> tuple[ModelSize, ...]:
    from shardline.diagnostics.bench import SIZES

    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SIZES]
    if unknown or not names:
        raise ConfigurationError(
            f"unknown model size(s) {unknown or [text]} in --sizes; choose a comma-separated list of {sorted(SIZES)}"
        )
    return tuple(SIZES[n] for n in names)


def _configs(text: str) -> tuple[str, ...]:
    return tuple(n.strip() for n in text.split(",") if n.strip())


def _cmd_bench(args: argparse.Namespace) -> int:
    from shardline.diagnostics.bench import BenchSettings, run_benchmark
    from shardline.diagnostics.bench.render import render_summary, write_results
    from shardline.diagnostics.bench.results import load_results

    if args.from_json:
        try:
            result = load_results(args.from_json)
            write_results(result, out_dir=args.out, plot=not args.no_plot)
        except ShardlineError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print("\n".join(render_summary(result)))
        print(f"wrote results.json, results.md{'' if args.no_plot else ', results.png'} to {args.out}")
        return 0
    try:
        settings = BenchSettings(
            sizes=_sizes(args.sizes),
            world_size=args.world_size,
            micro_batch=args.micro_batch,
            steps=args.steps,
            rounds=args.rounds,
            warmup=args.warmup,
            memory_steps=args.memory_steps,
            seed=args.seed,
            w1=not args.no_w1,
            hybrid=not args.no_hybrid,
            configs=_configs(args.configs),
            timeout_s=args.timeout,
        )
        command = "shardline " + " ".join(shlex.quote(a) for a in args.argv)
        result = run_benchmark(
            settings=settings,
            out_dir=args.out,
            command=command,
            plot=not args.no_plot,
            progress=lambda msg: print(msg, file=sys.stderr, flush=True),
        )
    except ShardlineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print("\n".join(render_summary(result)))
    for t in result.targets:
        print(f"target {'met    ' if t.met else 'MISSED '} {t.size:>8}: {t.name}: {t.detail}")
    print(f"wrote results.json, results.md{'' if args.no_plot else ', results.png'} to {args.out}")
    return 0


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, metavar="DIR", help="directory for results.json/.md/.png")
    parser.add_argument("--sizes", default="default,10x", help="comma-separated model sizes: tiny, default, 10x, 101m")
    parser.add_argument("--world-size", type=int, default=2, help="ranks of the main run (default 2)")
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences per rank per step (default 8)")
    parser.add_argument("--steps", type=int, default=2, help="steps per configuration per round (default 2)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating timing rounds (default 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per configuration first (default 2)")
    parser.add_argument("--memory-steps", type=int, default=2, help="steps measured in each memory probe (default 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-w1", action="store_true", help="skip the one-rank FULL_SHARD vs plain comparison")
    parser.add_argument(
        "--no-hybrid", action="store_true", help="skip the 4-rank HYBRID_SHARD vs FSDP2 HSDP comparison (2x2 mesh)"
    )
    parser.add_argument(
        "--configs",
        default="",
        help="comma-separated main-run configurations (default: all), e.g. "
        "shardline_full_shard,shardline_no_shard,torch_fsdp2,torch_ddp",
    )
    parser.add_argument("--no-plot", action="store_true", help="do not draw results.png (no matplotlib needed)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="hard deadline per process group, s")
    parser.add_argument(
        "--from-json", metavar="FILE", help="run nothing: re-render the results of an earlier results.json into --out"
    )


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``bench`` to the ``shardline`` command."""
    parser = subparsers.add_parser(
        "bench",
        help="benchmark shardline's engine against torch FSDP2, DDP and one process",
        description=(
            "Train the same GPT with shardline FULL_SHARD/SHARD_GRAD_OP/SHARD_OPT/NO_SHARD, torch FSDP2 and DDP on "
            "gloo ranks, alternating in one run, plus one process; shardline HYBRID_SHARD vs FSDP2's HSDP on a "
            "2x2 mesh; report step time, tokens/s, peak RSS, engine memory and bytes per step vs theory. See "
            "docs/benchmarks.md."
        ),
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_arguments(parser)
    parser.set_defaults(func=_cmd_bench)
