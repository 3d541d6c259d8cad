"""The ``shardline`` command: one parser, a subcommand for each adapter module of :mod:`shardline.cli`.

The convention every adapter follows (one for all commands):

* it exposes ``register(subparsers)``, which adds its subcommand(s) and sets ``func``, the handler;
* a handler takes the parsed :class:`argparse.Namespace` and returns the exit code, having printed
  its own output and errors; ``args.argv`` is the command line after ``shardline`` (what
  ``bench`` records in its results);
* a command that takes Hydra overrides (``train``, ``estimate``) sets ``positionals_into`` to the
  name of its positional list: overrides may then stand before and after its options;
* the adapters hold argument parsing and printing only; the work is done by the library
  (``shardline.train``, ``shardline.checkpoint``, ``shardline.diagnostics``, ``shardline.report``),
  and nothing in the library imports this package.

:func:`main` is the only entry point (``shardline = "shardline.cli:main"``; ``python -m shardline.cli``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from shardline._version import __version__
from shardline.cli import bench, checkpoint, env, estimate, plan, report, sign, train

__all__ = ["build_parser", "main"]

# In the order ``shardline --help`` lists them.
_COMMANDS = (train, estimate, plan, bench, checkpoint, sign, report, env)


def build_parser() -> argparse.ArgumentParser:
    """The ``shardline`` parser with every subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="shardline",
        description="Fully sharded data-parallel training on torch.distributed.",
    )
    parser.add_argument("--version", action="version", version=f"shardline {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in _COMMANDS:
        command.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``shardline ARGV`` (default: ``sys.argv[1:]``); returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
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
    args.argv = argv
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
