"""``shardline env``: versions and the communication backends this machine offers."""

from __future__ import annotations

import argparse
import platform

from shardline._version import __version__

__all__ = ["register"]


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


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``env`` to the ``shardline`` command."""
    env = subparsers.add_parser("env", help="print versions and available communication backends")
    env.set_defaults(func=_cmd_env)
