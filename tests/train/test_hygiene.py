"""Process hygiene: workers die with their launcher, and a resume removes what dead saves left behind --
never what a live process still owns."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.train.test_cli import GPT_SMALL, PYTHONPATH, ROOT, SMALL, shardline_train

# Seconds the workers may outlive a SIGKILLed launcher: the kernel's parent-death signal is
# immediate; the watchdog thread (the portable fallback) polls every second.
ORPHAN_LIMIT_S = 5.0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its new parent) is dead too
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _wait_for(check, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


_HOLDER = """
import sys, time
from pathlib import Path
from shardline.checkpoint.storage.fsutil import lock_tmp
tmp = Path(sys.argv[1])
lock_tmp(tmp)
tmp.mkdir()
print("holding", flush=True)
time.sleep(120)
"""


@pytest.mark.timeout(240)  # two launches, each with its own deadline
def test_workers_die_with_a_killed_launcher_and_the_resume_cleans_only_dead_leftovers(tmp_path: Path) -> None:
    run, pids = tmp_path / "run", tmp_path / "pids"
    pids.mkdir()
    env = {**os.environ, "PYTHONPATH": PYTHONPATH, "OMP_NUM_THREADS": "1"}
    common = [*SMALL, *GPT_SMALL, "checkpoint.every_n_steps=2", "~callbacks.tensorboard", "~callbacks.loss_plot"]
    launcher = subprocess.Popen(
        [
            sys.executable, "-m", "shardline.cli", "train", f"trainer.run_root={tmp_path}", *common,
            "trainer.max_steps=100000", f"trainer.run_dir={run}",
            "+callbacks.pids._target_=tests.train.helpers.RecordPid", f"+callbacks.pids.folder={pids}",
        ],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        _wait_for(lambda: (run / "checkpoints" / "step-2").is_dir(), 100, "the first checkpoint")
        workers = [int((pids / f"rank{r}.pid").read_text()) for r in range(2)]
        assert all(_alive(pid) for pid in workers)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=10)
        killed = time.monotonic()
        _wait_for(lambda: not any(_alive(pid) for pid in workers), ORPHAN_LIMIT_S, "the workers to die")
        print(f"workers gone {time.monotonic() - killed:.2f} s after the launcher's SIGKILL")
    finally:
        os.killpg(launcher.pid, signal.SIGKILL)  # whatever is left of this test's process group
        launcher.wait(timeout=10)

    # What crashed saves leave: a temporary checkpoint directory, its lock file, a `latest` rewrite.
    ckpts = run / "checkpoints"
    stale = ckpts / ".step-98.tmp-0123456789ab"
    stale.mkdir()
    (stale / "data.distcp").write_bytes(b"partial")
    stale.with_name(stale.name + ".lock").write_text("")  # its saver died: the lock file stays, unheld
    stale_latest = ckpts / ".latest.tmp-0123456789ab"
    stale_latest.write_text("step-98")
    # A save another live process holds: never removed under it.
    live = ckpts / ".step-99.tmp-ba9876543210"
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(live)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        resumed = shardline_train(*common, "trainer.max_steps=4", "trainer.resume=auto", f"trainer.run_dir={run}",
                                  run_root=tmp_path)  # fmt: skip
        assert resumed.returncode == 0, resumed.stderr
        assert not stale.exists()
        assert not stale.with_name(stale.name + ".lock").exists()
        assert not stale_latest.exists()
        assert live.is_dir(), "a temporary directory whose owner lives is left alone"
        assert f"leaving {live}" in (run / "logs" / "rank0.log").read_text()
    finally:
        holder.kill()
        holder.wait(timeout=10)
    names = {p.name for p in ckpts.iterdir() if not p.name.startswith(".step-99.")}
    assert "step-2" in names, names
    assert all(n.startswith("step-") or n in ("latest", ".shardline.lock") for n in names), names
