"""A scheduler's SIGTERM to every process of the job at once (SLURM's ``scancel`` or preemption,
``kill -TERM -- -PGID``): every rank finishes its step, ``step-N-preempted`` commits and verifies,
and the workers exit 143 well within ``trainer.preemption_grace_s``; a repeated SIGTERM does not
cut the save short. Under shardline's own launcher and under torchrun's agent.

Each job holds at the start of step 3 (``HoldOnNode``) until the test has signalled it, and the
step in flight then takes 6 s longer (``LingerOnPreemption``), longer than torch's launcher used
to wait (5 s) before SIGKILL.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from shardline.train.agentwait import grace_warning, torchrun_wait
from tests.train.test_cli import GPT_SMALL, PYTHONPATH, ROOT, SMALL, read_metrics
from tests.train.test_elastic import cli

STEP, LINGER_S, GRACE_S = 3, 6, 60
LAUNCH_S = 100  # each job's own deadline: a hang fails here


def _config(run: Path, gates: Path) -> list[str]:
    return [
        *SMALL,
        *GPT_SMALL,
        "checkpoint.every_n_steps=2",
        "~callbacks.tensorboard",
        "~callbacks.loss_plot",
        f"trainer.preemption_grace_s={GRACE_S}",
        f"trainer.run_dir={run}",
        f"trainer.run_root={run.parent}",
        "+callbacks.hold._target_=tests.train.helpers.HoldOnNode",
        "+callbacks.hold.node=job",
        f"+callbacks.hold.step={STEP}",
        f"+callbacks.hold.folder={gates}",
        "+callbacks.linger._target_=tests.train.helpers.LingerOnPreemption",
        f"+callbacks.linger.seconds={LINGER_S}",
        "+callbacks.pid._target_=tests.train.helpers.RecordPid",
        f"+callbacks.pid.folder={gates}",
    ]


def _gone(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie left to an init that does not reap counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def _signal_job_at_step(cmd: list[str], tmp: Path, gates: Path, *, every: list[str]) -> tuple[int, float, str]:
    """Run ``cmd`` in its own session; once step 3 started, SIGTERM every process of the job 3 times, 1.5 s apart.

    ``every``: how the job's processes are reached -- ``group`` (the session's process group) and,
    under torchrun, whose workers each lead their own group, ``workers``. Returns the launcher's
    exit code, the seconds from the first signal until every worker has exited, and the output.
    """
    env = {**os.environ, "PYTHONPATH": PYTHONPATH, "OMP_NUM_THREADS": "1", "SHARDLINE_TEST_NODE": "job"}
    out = tmp / "out.log"
    with open(out, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + LAUNCH_S
        pids = [gates / f"rank{r}.pid" for r in (0, 1)]
        while not ((gates / f"job-{STEP}.reached").exists() and all(p.exists() for p in pids)):
            assert proc.poll() is None, out.read_text()[-4000:]
            assert time.monotonic() < deadline, f"step {STEP} never started\n{out.read_text()[-4000:]}"
            time.sleep(0.1)
        workers = [int(p.read_text()) for p in pids]
        groups = ([proc.pid] if "group" in every else []) + (workers if "workers" in every else [])
        start = time.monotonic()
        for _ in range(3):  # a scheduler may repeat its SIGTERM: the save goes on
            for pgid in groups:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pgid, signal.SIGTERM)
            time.sleep(1.5)
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        while not all(_gone(pid) for pid in workers):  # torchrun's agent may exit first (its third SIGTERM)
            assert time.monotonic() < deadline, f"workers {workers} outlived the deadline\n{out.read_text()[-4000:]}"
            time.sleep(0.1)
        return proc.returncode, time.monotonic() - start, out.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        for pid in workers:  # a failed test leaves no worker behind, even one its agent left saving
            if not _gone(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def _assert_saved(run: Path, output: str, *, ranks_reporting: int) -> None:
    line = f"preempted (SIGTERM) after step {STEP}; saved step-{STEP}-preempted; continue with trainer.resume=auto"
    assert output.count(f"shardline: {line}") == ranks_reporting, output[-4000:]
    assert "second SIGTERM" not in output, output[-4000:]
    assert "without a preemption checkpoint" not in output, output[-4000:]
    assert "SIGTERM again: ignored" in output, "the repeated signal reached the job and was ignored"
    assert "error:" not in output, output[-4000:]
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == ["step-2", f"step-{STEP}-preempted"]
    cli("verify", str(run / "checkpoints" / f"step-{STEP}-preempted"))
    assert max(int(r["step"]) for r in read_metrics(run)) == STEP, "the step in flight was finished"
    assert not (run / ".shardline.lock").exists(), "the run directory's lock was released"


@pytest.mark.timeout(LAUNCH_S + 20)
def test_a_group_sigterm_saves_under_the_local_launcher(tmp_path: Path) -> None:
    run, gates = tmp_path / "run", tmp_path / "gates"
    gates.mkdir()
    cmd = [sys.executable, "-m", "shardline.cli", "train", *_config(run, gates)]
    code, took, output = _signal_job_at_step(cmd, tmp_path, gates, every=["group"])
    assert code == 143, output[-4000:]
    _assert_saved(run, output, ranks_reporting=1)  # the launcher reports for every rank
    assert "SIGTERM: the workers finish the step in flight and save it" in output
    print(f"group SIGTERM -> exit 143 in {took:.1f} s (step lingers {LINGER_S} s, grace {GRACE_S} s)")
    assert LINGER_S <= took < GRACE_S / 2, f"exited {took:.1f} s after the signal"


@pytest.mark.timeout(LAUNCH_S + 20)
def test_a_sigterm_to_every_process_saves_under_torchrun(tmp_path: Path) -> None:
    run, gates = tmp_path / "run", tmp_path / "gates"
    gates.mkdir()
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--monitor-interval=0.5",
        f"--shutdown-timeout={GRACE_S + 10}", "-m", "shardline.cli", "train", *_config(run, gates),
    ]  # fmt: skip
    # torchrun starts each worker in its own session: "every process" is the agent's group and each worker's.
    code, took, output = _signal_job_at_step(cmd, tmp_path, gates, every=["group", "workers"])
    # Each worker prints its line as it exits 143. torchrun's agent ends with its own exit code (torch 2.13: 1,
    # re-raising the signal) and, at its third SIGTERM, at once: the workers finish their save without it.
    print(f"torchrun's agent exited {code}")
    _assert_saved(run, output, ranks_reporting=2)
    assert "forcefully exiting via SIGKILL" not in output, "the agent never killed its workers"
    assert "the launcher (pid" not in output, "no worker exited because its agent was gone"
    assert "warning: trainer.preemption_grace_s" not in output, "--shutdown-timeout covers the grace"
    print(f"SIGTERM to every process under torchrun -> workers done in {took:.1f} s")
    assert LINGER_S <= took < GRACE_S / 2, f"exited {took:.1f} s after the signal"


_GUARD = textwrap.dedent(
    """
    import os, signal, sys, time
    # Python's own SIGINT handler, as a job started from a terminal has it (a shell's background job -- a CI
    # runner's, say -- starts with SIGINT ignored, and Python then installs none).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from shardline.train.preemption import PreemptionGuard
    guard = PreemptionGuard(grace_s=float(sys.argv[1]), world_size=1, backend="gloo", timeout_s=5).install()
    assert not guard.agreed()
    for name in sys.argv[2].split(","):
        os.kill(os.getpid(), getattr(signal, name))
    print("agreed", guard.agreed(), flush=True)
    guard.uninstall()  # the training loop ended (a preemption save committed): a late SIGTERM must not kill it
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)
    print("still alive", flush=True)
    """
)


@pytest.mark.parametrize(
    ("grace_s", "signals", "code"),
    [(1.0, "SIGTERM", 143), (3.0, "SIGTERM,SIGTERM,SIGTERM", 143), (60.0, "SIGTERM,SIGINT", -signal.SIGINT)],
    ids=["deadline", "repeated-sigterm", "sigint"],
)
def test_repeated_sigterms_wait_for_the_deadline_and_another_signal_ends_it(
    grace_s: float, signals: str, code: int
) -> None:
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", _GUARD, str(grace_s), signals], capture_output=True, text=True, env=env, timeout=60
    )
    took = time.monotonic() - start
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert "still alive" not in proc.stdout
    assert "second SIGTERM" not in proc.stderr
    if code == 143:
        assert "agreed True" in proc.stdout, "the signal is seen at the next agreement, whatever the repeats"
        assert f"trainer.preemption_grace_s={grace_s:g} ran out" in proc.stderr
        # every SIGTERM after the first, the late one after uninstall() included, is ignored
        assert proc.stderr.count("SIGTERM again: ignored") == signals.count("SIGTERM"), proc.stderr
        assert grace_s <= took < grace_s + 8, f"exited after {took:.1f} s"
    else:
        assert "agreed" not in proc.stdout, "SIGINT ends the save at once (KeyboardInterrupt)"
        assert "KeyboardInterrupt" in proc.stderr
        assert took < 10, f"exited after {took:.1f} s"


def _fake_agent(*args: str) -> subprocess.Popen:
    """A process whose command line reads like a torchrun agent's (it only sleeps)."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", *args])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the agent's command line from /proc")
def test_the_torchrun_wait_is_read_from_the_agent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PET_SHUTDOWN_TIMEOUT", raising=False)
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    agents = {
        "default": _fake_agent("torch.distributed.run", "--standalone", "-m", "shardline.cli", "train"),
        "flag": _fake_agent("torch.distributed.run", "--shutdown-timeout", "200", "-m", "shardline.cli"),
        "flag=": _fake_agent("torch.distributed.run", "--shutdown_timeout=90", "-m", "shardline.cli"),
        "script": _fake_agent("torch.distributed.run", "--standalone", "train.py", "--shutdown-timeout=5"),
        "other": _fake_agent("mpirun", "--shutdown-timeout=5"),
    }
    try:
        time.sleep(0.3)  # each has exec'd its interpreter
        wait = {name: torchrun_wait(parent_pid=agent.pid) for name, agent in agents.items()}
        assert (wait["default"].seconds, wait["default"].source) == (30, "torchrun's default")
        assert (wait["flag"].seconds, wait["flag"].source) == (200, "torchrun --shutdown-timeout")
        assert wait["flag="].seconds == 90
        assert wait["script"].seconds == 30, "only torchrun's own options count, not the script's"
        assert wait["other"] is None, "nothing is claimed under another launcher"
        line = grace_warning(120, parent_pid=agents["default"].pid)
        assert line is not None
        assert "(30 s, torchrun's default)" in line, line
        assert "--shutdown-timeout=130 (or TORCH_ELASTIC_SHUTDOWN_TIMEOUT=130)" in line, line
        assert grace_warning(120, parent_pid=agents["flag"].pid) is None
        assert grace_warning(20, parent_pid=agents["default"].pid) is None
        monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "150")
        assert torchrun_wait(parent_pid=agents["default"].pid).seconds == 150
        assert torchrun_wait(parent_pid=agents["flag"].pid).seconds == 200, "the flag wins over the environment"
    finally:
        for agent in agents.values():
            agent.kill()
            agent.wait(timeout=10)


_RELAY = textwrap.dedent(
    """
    import os, signal, subprocess, sys
    from shardline.train.relay import SigtermRelay
    code = "import signal, time; signal.signal(signal.SIGTERM, lambda *a: print('got SIGTERM', flush=True)); "
    worker = subprocess.Popen([sys.executable, "-c", code + "print('ready', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    assert worker.stdout.readline() == "ready\\n"
    relay = SigtermRelay(grace_s=1.0, pids=lambda: [worker.pid], margin_s=0.5).install()
    for _ in range(3):
        os.kill(os.getpid(), signal.SIGTERM)
    code = worker.wait(timeout=20)
    relay.uninstall()
    print("worker", worker.stdout.read().split("\\n").count("got SIGTERM"), code, relay.killed == [worker.pid])
    """
)


def test_the_launcher_passes_sigterm_on_once_ignores_repeats_and_kills_at_the_deadline() -> None:
    """What the local launcher does with its own SIGTERM (``docker stop`` or ``kill PID`` reach it alone)."""
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    proc = subprocess.run([sys.executable, "-c", _RELAY], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr  # the repeats did not kill the launcher
    assert proc.stdout.split() == ["worker", "1", str(-signal.SIGKILL), "True"], proc.stdout + proc.stderr
    assert "SIGTERM: the workers finish the step in flight and save it" in proc.stderr
    assert "SIGTERM again: ignored" in proc.stderr
    assert "still ran 1.5 s after SIGTERM (trainer.preemption_grace_s=1); killed" in proc.stderr, proc.stderr
