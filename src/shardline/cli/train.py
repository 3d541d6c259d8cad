"""The ``shardline train`` subcommand: argument parsing and help built from the config schema."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import textwrap

from shardline.train import schema
from shardline.train.config_layers import shipped_options

__all__ = ["register"]

_EXAMPLES = """\
examples:
  shardline train                                   the default: tiny GPT, 2 CPU workers, FULL_SHARD
  shardline train trainer.strategy=ddp              another base strategy (fsdp, zero2, zero1, ddp, hsdp, single_device)
  shardline train experiment=[tiny_gpt,fsdp_args] trainer.devices=2 ++trainer.precision=bf16-mixed ~callbacks.progress
  shardline train experiment=hf_llama               a tiny Hugging Face Llama (pip install 'shardline[hf]')
  shardline train experiment=hf_lora                LoRA fine-tuning of a tiny Llama, then the adapter exported
  shardline train -cd my_configs experiment=my_lm   your own experiment files (my_configs/experiment/my_lm.yaml)
  shardline train experiment=path/to/my_lm.yaml     an experiment file by path
  shardline train --cfg job                         print the resolved config and exit
"""


def _field_docs() -> dict[str, dict[str, str]]:
    """Docstrings written under dataclass fields in schema.py, by class and field."""
    tree = ast.parse(inspect.getsource(schema))
    docs: dict[str, dict[str, str]] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        fields: dict[str, str] = {}
        body = node.body
        for stmt, nxt in itertools.pairwise(body):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                fields[stmt.target.id] = " ".join(nxt.value.value.split())
        docs[node.name] = fields
    return docs


def config_help() -> str:
    """The help text listing every config key with its default and documentation."""
    docs = _field_docs()
    lines = [
        "config groups:",
        f"  trainer.strategy=NAME   base strategy: {', '.join(shipped_options('trainer_strategy'))}",
        f"  experiment=NAME|[A,B]   overlays: {', '.join(shipped_options('experiment'))}; or PATH.yaml",
        "  -cd/--config-dir DIR    a folder with more experiment/ and trainer_strategy/ YAML files",
        "",
        "config keys (set with key=value, add with ++key=value, remove with ~key):",
    ]

    def walk(cls: type, prefix: str) -> None:
        for f in dataclasses.fields(cls):
            key = f"{prefix}{f.name}"
            factory = f.default_factory if f.default_factory is not dataclasses.MISSING else None
            default = factory() if factory is not None else f.default
            if dataclasses.is_dataclass(default):
                walk(type(default), key + ".")
                continue
            doc = docs.get(cls.__name__, {}).get(f.name, "")
            lines.append(f"  {key} = {default!r}")
            if doc:
                lines.extend(textwrap.wrap(doc, width=96, initial_indent="      ", subsequent_indent="      "))

    walk(schema.TrainConfig, "")
    return "\n".join(lines)


def _cmd_train(args: argparse.Namespace) -> int:
    if args.help_config:
        print(config_help())
        return 0
    from shardline.train.launcher import train

    return train(args.overrides, print_config=args.cfg == "job", config_dirs=args.config_dir or ())


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``train`` to the ``shardline`` command."""
    parser = subparsers.add_parser(
        "train",
        help="train a model with sharded data parallelism (Hydra-style overrides)",
        description="Train with configs composed from trainer_strategy/ and experiment/ plus overrides.",
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="Hydra overrides (see --help-config)")
    parser.add_argument("--cfg", choices=["job"], help="print the resolved config ('job') and exit")
    parser.add_argument(
        "-cd",
        "--config-dir",
        action="append",
        metavar="DIR",
        help="a folder with more experiment/NAME.yaml and trainer_strategy/NAME.yaml files (repeatable)",
    )
    parser.add_argument("--help-config", action="store_true", help="list every config key with its documentation")
    parser.set_defaults(func=_cmd_train, positionals_into="overrides")
