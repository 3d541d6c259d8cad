"""A process that exits while its async save is still writing: the save commits and the interpreter ends cleanly
(a daemon thread stopped inside a torch call at teardown ends the process with SIGABRT, "terminate called without
an active exception")."""

from __future__ import annotations

from pathlib import Path

import shardline.checkpoint as ckpt
from tests.two_ranks import run_two_ranks

SCRIPT = Path(__file__).with_name("exit_script.py")


def test_an_async_save_still_writing_at_exit_commits_and_the_process_exits_cleanly(tmp_path: Path) -> None:
    directory = tmp_path / "checkpoints"
    for rank, (code, out) in enumerate(run_two_ranks(SCRIPT, str(tmp_path / "rendezvous"), str(directory))):
        assert "terminate called" not in out, out
        assert code == 0, f"rank {rank} exited {code}:\n{out}"
        assert f"rank {rank}: staged, leaving" in out, out
        assert "is still writing: waiting for it to finish" in out, out
    assert ckpt.verify_checkpoint(directory / "step-1").ok
    assert [r.step for r in ckpt.Ledger(directory / "lineage.sqlite").rows()] == [1]
