"""The engine benchmark runs end to end on a tiny model and writes well-formed results.

No timing number is asserted (the machine is shared and noisy); communication volume is
deterministic, so shardline's measured bytes per step must equal the theory exactly.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from shardline.cli import main
from shardline.diagnostics.bench import (
    HYBRID_RUN,
    MAIN_RUN,
    SIZES,
    BenchResult,
    BenchSettings,
    ModelSize,
    issued_on_gloo,
    run_benchmark,
)
from shardline.diagnostics.bench.results import load_results, to_json
from shardline.errors import ConfigurationError
from tests.numerics import close_ratio

TINY = ModelSize(name="tiny", dim=32, n_layers=2, n_heads=2, seq_len=16)
FAST = {"world_size": 2, "micro_batch": 2, "steps": 2, "rounds": 1, "warmup": 1, "memory_steps": 1, "timeout_s": 50.0}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[BenchResult, Path]:
    out = tmp_path_factory.mktemp("bench")
    result = run_benchmark(settings=BenchSettings(sizes=(TINY,), **FAST), out_dir=out, command="test")
    return result, out


def _positive(x: float) -> bool:
    return math.isfinite(x) and x > 0


def test_every_configuration_is_measured(tiny_run: tuple[BenchResult, Path]) -> None:
    result, _ = tiny_run
    main = result.run("tiny")
    assert main is not None
    assert main.world_size == 2
    assert [c.key for c in main.configs] == list(MAIN_RUN)
    for c in main.configs:
        assert c.ranks == (1 if c.key == "one_process" else 2), c.key
        assert c.step.n == FAST["steps"] * FAST["rounds"], c.key
        assert all(_positive(v) for v in (c.step.median, c.step.min, c.step.max, c.tokens_per_s)), c.key
        assert c.step.min <= c.step.p25 <= c.step.median <= c.step.p75 <= c.step.max, c.key
        assert all(_positive(c.phases[p].median) for p in ("forward", "backward", "optimizer")), c.key
        assert len(c.memory) == c.ranks, c.key  # the probe runs one process per rank that trains
        for m in c.memory:
            assert (m.baseline or 0) > 0, c.key
            assert m.state is not None, c.key
            assert m.step is not None, c.key
            assert m.step >= 0, c.key
        assert c.tokens_per_step == 2 * FAST["micro_batch"] * TINY.seq_len
        # Same seed, same global batch: every configuration starts from the same loss.
        assert close_ratio(c.first_loss, main.configs[0].first_loss) <= 1, c.key  # assert_close's fp32 defaults


def test_bytes_per_step_match_theory(tiny_run: tuple[BenchResult, Path]) -> None:
    result, _ = tiny_run
    main, w1 = result.run("tiny"), result.run("tiny", "w1")
    assert main is not None
    assert w1 is not None
    by_key = {c.key: c for c in main.configs}
    for key in ("shardline_full_shard", "shardline_shard_grad_op", "shardline_no_shard", "shardline_shard_opt"):
        comm = by_key[key].comm
        assert comm.engine == comm.theory, key  # shardline's own log, by logical kind
        # Every c10d collective, seen by the dispatch mode: on gloo shardline issues its all-gathers and
        # reduce-scatters as all-reduces of the same buffers.
        assert comm.measured == issued_on_gloo(comm.theory) == {"all_reduce": sum(comm.theory.values())}, key
    full, zero2 = by_key["shardline_full_shard"].comm.theory, by_key["shardline_shard_grad_op"].comm.theory
    assert set(full) == {"all_gather", "reduce_scatter"}
    assert full["reduce_scatter"] == zero2["reduce_scatter"] < full["all_gather"] < 2 * zero2["all_gather"]
    assert set(by_key["shardline_no_shard"].comm.theory) == {"all_reduce"}
    # ZeRO-1: NO_SHARD's all-reduce plus one all-gather of every unit (the optimizer's updated rows).
    zero1 = by_key["shardline_shard_opt"].comm.theory
    assert zero1["all_reduce"] == by_key["shardline_no_shard"].comm.theory["all_reduce"]
    assert zero1["all_gather"] == zero2["all_gather"]
    # The dispatch mode sees torch's collectives too. FSDP2 gathers every block again in backward;
    # shardline keeps the block that ran last (backward starts with it), so it moves one block less.
    fsdp2 = by_key["torch_fsdp2"].comm
    assert fsdp2.measured == fsdp2.theory
    assert fsdp2.theory["reduce_scatter"] == full["reduce_scatter"]
    # Two identical blocks: shardline re-gathers one of them in backward, FSDP2 both.
    one_block = full["all_gather"] - zero2["all_gather"]
    assert one_block > 0
    assert fsdp2.theory["all_gather"] - full["all_gather"] == one_block
    assert by_key["torch_ddp"].comm.measured == by_key["torch_ddp"].comm.theory
    assert by_key["torch_ddp"].comm.theory == by_key["shardline_no_shard"].comm.theory
    assert by_key["one_process"].comm.measured == {}
    assert all(c.comm.matches for c in main.configs)
    for c in w1.configs:  # nothing to communicate at W=1
        assert c.comm.theory == c.comm.measured == {}, c.key


def test_hybrid_run_compares_with_fsdp2_hsdp(tiny_run: tuple[BenchResult, Path]) -> None:
    result, _ = tiny_run
    hybrid = result.run("tiny", "hybrid")
    assert hybrid is not None
    assert hybrid.world_size == 4
    assert [c.key for c in hybrid.configs] == list(HYBRID_RUN)
    ours, peer = hybrid.configs
    assert ours.ranks == peer.ranks == 4
    assert close_ratio(ours.first_loss, peer.first_loss) <= 1  # assert_close's fp32 defaults
    assert ours.comm.engine == ours.comm.theory
    assert ours.comm.measured == issued_on_gloo(ours.comm.theory)
    assert peer.comm.measured == peer.comm.theory
    # Both reduce-scatter inside the shard group of 2 and all-reduce the reduced half across replicas;
    # FSDP2 gathers the last block once more in backward.
    assert ours.comm.theory["reduce_scatter"] == peer.comm.theory["reduce_scatter"]
    assert ours.comm.theory["all_reduce"] == peer.comm.theory["all_reduce"] == ours.comm.theory["reduce_scatter"] // 2
    assert ours.comm.theory["all_gather"] < peer.comm.theory["all_gather"]


def test_w1_compares_full_shard_with_the_plain_model(tiny_run: tuple[BenchResult, Path]) -> None:
    result, _ = tiny_run
    w1 = result.run("tiny", "w1")
    assert w1 is not None
    assert w1.world_size == 1
    assert [c.key for c in w1.configs] == ["plain", "shardline_full_shard"]
    plain, ours = w1.configs
    assert plain.tokens_per_step == ours.tokens_per_step == 2 * FAST["micro_batch"] * TINY.seq_len
    assert _positive(plain.step.median)
    assert _positive(ours.step.median)
    assert ours.first_loss == plain.first_loss, "one rank: the same kernels on the same values, bit for bit"
    names = {(t.name, t.size) for t in result.targets}
    assert names == {
        ("FULL_SHARD step time / FSDP2", "tiny"),
        ("NO_SHARD step time / DDP", "tiny"),
        ("HYBRID_SHARD step time / FSDP2 HSDP (W=4)", "tiny"),
        ("FULL_SHARD peak RSS / FSDP2", "tiny"),
        ("shardline bytes/step == theory", "tiny"),
        ("W=1 overhead vs plain model", "tiny"),
    }
    assert next(t for t in result.targets if t.name.endswith("theory")).met


def test_files_are_well_formed(tiny_run: tuple[BenchResult, Path]) -> None:
    _, out = tiny_run
    data = json.loads((out / "results.json").read_text())
    assert data["schema"] == "shardline.bench/1"
    assert {"torch", "cpu_model", "cpu_count", "date", "command"} <= set(data["environment"])
    assert [(r["kind"], r["world_size"]) for r in data["runs"]] == [("main", 2), ("hybrid", 4), ("w1", 1)]
    row = data["runs"][0]["configs"][0]
    assert {
        "step_s",
        "tokens_per_s",
        "ratio_vs_fsdp2",
        "rss_bytes",
        "comm_bytes_per_step",
        "engine_memory_bytes",
    } <= set(row)
    assert row["comm_bytes_per_step"]["matches_theory"] is True
    assert len(row["step_s"]["samples"]) == FAST["steps"] * FAST["rounds"]  # the raw numbers are kept
    assert [len(r) for r in row["step_s_per_rank"]] == [FAST["steps"] * FAST["rounds"]] * 2
    markdown = (out / "results.md").read_text()
    for label in (
        "shardline FULL_SHARD",
        "shardline SHARD_GRAD_OP",
        "shardline NO_SHARD",
        "shardline SHARD_OPT",
        "shardline HYBRID_SHARD 2x2",
        "torch FSDP2 HSDP 2x2",
        "torch FSDP2",
        "torch DDP",
        "one process, global batch",
    ):
        assert f"| {label} |" in markdown
    for column in (
        "step time, ms: median [IQR]",
        "tokens/s",
        "vs FSDP2",
        "peak RSS/rank",
        "bytes/step measured",
        "theory",
    ):
        assert column in markdown
    png = (out / "results.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    assert len(png) > 1000


def test_results_reload_and_rerender(tiny_run: tuple[BenchResult, Path], tmp_path: Path) -> None:
    _, out = tiny_run
    original = json.loads((out / "results.json").read_text())
    assert json.loads(json.dumps(to_json(load_results(out / "results.json")))) == original
    assert main(["bench", "--out", str(tmp_path), "--from-json", str(out / "results.json"), "--no-plot"]) == 0
    assert json.loads((tmp_path / "results.json").read_text()) == original
    assert (tmp_path / "results.md").read_text() == (out / "results.md").read_text()


def test_cli_rejects_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--out", str(tmp_path), "--sizes", "huge"]) == 1
    err = capsys.readouterr().err
    assert "huge" in err
    assert "default" in err
    assert main(["bench", "--out", str(tmp_path), "--sizes", "tiny", "--world-size", "1"]) == 1
    assert "world_size" in capsys.readouterr().err
    assert main(["bench", "--out", str(tmp_path), "--from-json", str(tmp_path / "missing.json")]) == 1
    assert "missing.json" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_settings_are_validated() -> None:
    with pytest.raises(ConfigurationError, match="rounds"):
        BenchSettings(rounds=0).validate()
    with pytest.raises(ConfigurationError, match="distinct"):
        BenchSettings(sizes=(SIZES["tiny"], SIZES["tiny"])).validate()
    with pytest.raises(ConfigurationError, match="divisible"):
        BenchSettings(sizes=(ModelSize(name="odd", dim=30, n_layers=1, n_heads=4),)).validate()
    with pytest.raises(ConfigurationError, match="unknown configuration"):
        BenchSettings(configs=("torch_fsdp3",)).validate()
    BenchSettings().validate()
    assert BenchSettings(configs=("torch_ddp", "shardline_no_shard")).main_configs == (
        "shardline_no_shard",
        "torch_ddp",
    )
