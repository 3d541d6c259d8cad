"""``shardline train trainer.compile=true``: each wrapped block compiled, the same losses as eager."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch import nn

import shardline
from shardline.testing import run_distributed
from shardline.train.compiling import compile_units
from tests.numerics import assert_trajectories
from tests.train.test_cli import SMALL, error_line, only_run_dir, read_metrics, shardline_train

TINY = ["model.dim=32", "model.n_layers=2", "trainer.max_steps=4"]


def _losses(run_root: Path, *overrides: str) -> tuple[list[float], list[float], str]:
    """Training and validation losses of a run, and rank 0's log."""
    proc = shardline_train(*SMALL, *TINY, *overrides, run_root=run_root, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = only_run_dir(run_root)
    rows = read_metrics(run_dir)
    train = [float(r["loss"]) for r in rows if r["loss"]]
    val = [float(r["val_loss"]) for r in rows if r["val_loss"]]
    return train, val, (run_dir / "logs" / "rank0.log").read_text()


# Compiling the block's forward and backward takes 20-40 s on 2 busy CPU cores.
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_compiled_training_equals_eager(tmp_path: Path) -> None:
    eager, eager_val, eager_log = _losses(tmp_path / "eager")
    compiled, compiled_val, log = _losses(tmp_path / "compiled", "trainer.compile=true")
    assert "torch.compile" not in eager_log
    assert "torch.compile on 2 modules" in log, log  # the two blocks, not the root
    assert len(compiled) == 4
    assert_trajectories(compiled, eager, "trainer.compile=true vs eager")
    assert_trajectories(compiled_val, eager_val, "trainer.compile=true vs eager, validation")


class _Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(2, 2)
        self.outer = nn.Linear(2, 2)


def _compiled_units(rank: int, world_size: int) -> list[list[str]]:
    nested = nn.Sequential(_Pair(), _Pair(), nn.Linear(2, 2))
    for pair in nested[:2]:
        shardline.fully_shard(pair.inner)
        shardline.fully_shard(pair)
    shardline.fully_shard(nested)
    single = shardline.fully_shard(nn.Linear(2, 2))
    names = {id(m): name for name, m in nested.named_modules()}
    return [[names[id(m)] for m in compile_units(nested)], [str(m is single) for m in compile_units(single)]]


def test_compile_units_compiles_the_outermost_units_below_the_root() -> None:
    outermost, single = run_distributed(_compiled_units, 1)[0]
    assert outermost == ["0", "1"], "a unit inside a compiled unit is compiled with it; the root stays eager"
    assert single == ["True"], "a model that is one unit is compiled whole"


def test_compile_under_the_default_kernel_set_is_one_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Under ATEN_CPU_CAPABILITY=default inductor's C++ does not build (torch 2.13); the run says so in one line
    # before compiling anything, instead of a compiler log out of the first forward pass.
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    proc = shardline_train(*SMALL, *TINY, "trainer.compile=true", run_root=tmp_path, timeout=110)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = error_line(proc.stderr)
    assert "trainer.compile=true on CPU with the default kernel set" in line, proc.stderr
    assert "trainer.compile=false" in line
    assert "at::vec" not in proc.stderr, "the compiler's own log must not reach the user"
