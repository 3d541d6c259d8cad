"""The ``shardline`` command: one adapter module per subcommand (see :mod:`.main` for the conventions)."""

from shardline.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
