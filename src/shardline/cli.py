"""The ``shardline`` command."""

from __future__ import annotations

import argparse
import platform
import sys
from collections.abc import Sequence

from shardline._version import __version__

__all__ = ["main"]


def _cmd_env(_args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    rows = [
        ("shardline", __version__),
        ("python", platform.python_version()),
        ("torch", torch.__version__),
        ("cuda available", str(torch.cuda.is_available())),
        ("cuda devices", str(torch.cuda.device_count())),
        ("gloo available", str(dist.is_available() and dist.is_gloo_available())),
        ("nccl available", str(dist.is_available() and dist.is_nccl_available())),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardline",
        description="Fully sharded data-parallel training on torch.distributed.",
    )
    parser.add_argument("--version", action="version", version=f"shardline {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    from shardline.checkpoint.cli import register as register_checkpoint
    from shardline.checkpoint.sign_cli import register as register_sign
    from shardline.diagnostics.bench_cli import register as register_bench
    from shardline.diagnostics.estimate_cli import register as register_estimate
    from shardline.report.cli import register as register_report
    from shardline.train.cli import register as register_train

    register_train(sub)
    register_estimate(sub)
    register_bench(sub)
    register_checkpoint(sub)
    register_sign(sub)
    register_report(sub)
    env = sub.add_parser("env", help="print versions and available communication backends")
    env.set_defaults(func=_cmd_env)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``shardline`` console script."""
    parser = build_parser()
    # Note: ``shardline train a=1 -cd DIR b=2`` -- argparse stops collecting a subcommand's
    # positional list at the first option, so what follows it comes back as "unknown"; a command
    # that declares ``positionals_into`` takes those back, in order.
    args, extras = parser.parse_known_args(argv)
    into = getattr(args, "positionals_into", None)
    if extras and into and not any(e.startswith("-") for e in extras):
        getattr(args, into).extend(extras)
    elif extras:
        parser.error(f"unrecognized arguments: {' '.join(extras)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
