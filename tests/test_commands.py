"""The ``shardline`` command: every subcommand answers ``--help`` with its options, and no option
appears or disappears without this list (and the docs that describe it) being updated."""

from __future__ import annotations

import argparse

import pytest

from shardline.cli import build_parser, main

# Every subcommand's options and positionals. A change here is a change of the command line:
# update docs/*.md and README.md where they show the command, then this list.
OPTIONS: dict[str, list[str]] = {
    "train": ["--cfg", "--config-dir", "--help-config", "-cd", "overrides"],
    "estimate": ["--json", "--lora-rank", "--lora-targets", "--offload", "--quantize", "--world-size", "overrides"],
    "plan": [
        "--ac",
        "--calibrate",
        "--calibration",
        "--global-batch",
        "--gpu",
        "--gpus-per-node",
        "--hf-config",
        "--host-link-gbps",
        "--inter-node-gbps",
        "--intra-node-gbps",
        "--json",
        "--lora-rank",
        "--lora-targets",
        "--memory-gib",
        "--micro-batch",
        "--nodes",
        "--offload",
        "--peak-tflops",
        "--plot",
        "--precision",
        "--quantize",
        "--reduce-dtype",
        "--reshard-after-forward",
        "--save-calibration",
        "--seq-len",
        "--shard-size",
        "--strategy",
        "--top",
        "overrides",
    ],
    "bench": [
        "--configs",
        "--from-json",
        "--memory-steps",
        "--micro-batch",
        "--no-hybrid",
        "--no-plot",
        "--no-w1",
        "--out",
        "--rounds",
        "--seed",
        "--sizes",
        "--steps",
        "--timeout",
        "--warmup",
        "--world-size",
    ],
    "verify": ["--expect", "--json", "--level", "--public-key", "--signature", "--storage-option", "checkpoint"],
    "inspect": ["--json", "--storage-option", "checkpoint"],
    "consolidate": [
        "--adapters",
        "--dtype",
        "--expect",
        "--json",
        "--max-shard-size",
        "--storage-option",
        "--verify",
        "checkpoint",
        "out",
    ],
    "lineage": [
        "--json",
        "--ledger",
        "--limit",
        "--new-chain",
        "--no-check-checkpoints",
        "--record-deletions",
        "--since",
        "--storage-option",
        "run_dir",
    ],
    "adopt": ["--json", "--ledger", "--step", "--storage-option", "--subfolders", "checkpoint"],
    "sign": [
        "--expect",
        "--force",
        "--json",
        "--password-env",
        "--private-key",
        "--signature",
        "--storage-option",
        "path",
    ],
    "report": ["--limit", "--out", "--public-key", "--storage-option", "run_dir"],
    "env": [],
}


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _options(parser: argparse.ArgumentParser) -> list[str]:
    names: list[str] = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        names.extend(action.option_strings or [action.dest])
    return sorted(names)


def test_no_option_sneaks_in_or_out() -> None:
    commands = _subcommands()
    assert list(commands) == list(OPTIONS), "the subcommands, in the order `shardline --help` lists them"
    for name, parser in commands.items():
        assert _options(parser) == sorted(OPTIONS[name]), (
            f"`shardline {name}` options changed: update the docs that show them, then OPTIONS in this test"
        )


def test_the_top_level_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for name in OPTIONS:
        assert f"\n    {name} " in out or f"\n    {name}\n" in out, name


@pytest.mark.parametrize("name", list(OPTIONS))
def test_every_subcommand_help_lists_its_options(
    name: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # no wrapping: each help text stays on one line
    with pytest.raises(SystemExit) as exit_info:
        main([name, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: shardline {name} ")
    parser = _subcommands()[name]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        for shown in action.option_strings or [action.metavar or action.dest]:
            assert shown in out, f"`shardline {name} --help` does not show {shown}"
        if action.help:
            assert " ".join(action.help.split()[:3]) in " ".join(out.split()), action.help


def test_a_command_without_a_subcommand_prints_the_help_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert capsys.readouterr().out.startswith("usage: shardline ")


def test_overrides_may_stand_after_options(capsys: pytest.CaptureFixture[str]) -> None:
    # train and estimate take Hydra overrides before and after their options, alike.
    assert main(["train", "data.seq_len=64", "--cfg", "job", "trainer.max_steps=3"]) == 0
    out = capsys.readouterr().out
    assert "seq_len: 64" in out
    assert "max_steps: 3" in out
    assert main(["estimate", "--json", "trainer.strategy=ddp"]) == 0
    assert '"strategy": "no_shard"' in capsys.readouterr().out
