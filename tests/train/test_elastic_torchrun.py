"""``shardline train`` under elastic torchrun on two simulated nodes (two agents on 127.0.0.1, one
worker each, one shared run directory): lose a node, keep training, grow back.

One scenario covers the checks, since each elastic launch costs tens of seconds on two cores:
kill one agent's whole process group while its peer waits in a collective -> the survivor fails
fast and torchrun restarts it at world size 1, resuming from the newest checkpoint without any
flag -> a third agent joins -> torchrun stops the worker (SIGTERM: a preemption save) and
restarts both at world size 2 -> the job finishes. Every step's ``data_digest`` equals an
uninterrupted run's, the losses after each restart agree with it, and the ledger records both
restarts with their causes.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from shardline.distributed import free_port
from tests.numerics import assert_trajectories
from tests.train.test_cli import PYTHONPATH, ROOT, read_metrics
from tests.train.test_elastic import COMMON, GLOBAL, STEPS, cli, straight  # noqa: F401 - straight is a fixture

CONFIG = [
    *COMMON,  # the uninterrupted reference (`straight`) is COMMON on two ranks
    f"trainer.global_batch_size={GLOBAL}",  # its global batch, whichever world size the first rendezvous forms
    "trainer.collective_timeout_s=30",
]
LOST_AT, JOINED_AT = 5, 9  # node B is killed holding step 5; node A holds step 9 until node C joins
SCENARIO_S = 240


def _agent(node: str, run_dir: Path, port: int, gates: Path, *, host: bool) -> subprocess.Popen:
    """One simulated node: a torchrun agent in its own process group (so it can be killed whole)."""
    rdzv = f"is_host={int(host)},join_timeout=60,last_call_timeout=5,close_timeout=10"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=1",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=shardline-elastic-test",
        f"--rdzv-conf={rdzv}", "--max-restarts=3", "--monitor-interval=0.5",
        "-m", "shardline.cli", "train", *CONFIG, f"trainer.run_dir={run_dir}",
        "+callbacks.lose._target_=tests.train.helpers.HoldOnNode", "+callbacks.lose.node=B",
        f"+callbacks.lose.step={LOST_AT}", f"+callbacks.lose.folder={gates}",
        "+callbacks.join._target_=tests.train.helpers.HoldOnNode", "+callbacks.join.node=A",
        f"+callbacks.join.step={JOINED_AT}", f"+callbacks.join.folder={gates}",
    ]  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": PYTHONPATH,
        "OMP_NUM_THREADS": "1",
        "SHARDLINE_TEST_NODE": node,
        # torch 2.13's agents share the rendezvous TCP store with the workers by default; after a
        # membership change the surviving rank-0 agent keeps the previous round's address and never
        # publishes it in the new round, so a joining agent waits for it until its timeout. This
        # documented opt-out gives each round its own published address (docs/training.md).
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }
    log = open(gates / f"agent-{node}.log", "w")  # noqa: SIM115 - the agent writes it until it exits
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _wait(check, deadline: float, what: str, agents: dict[str, subprocess.Popen], gates: Path) -> None:
    while not check():
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- agent {n}\n{(gates / f'agent-{n}.log').read_text()[-3000:]}" for n in agents)
            raise AssertionError(f"timed out waiting for {what}\n{logs}")
        time.sleep(0.2)


def _log_time(line: str) -> float:
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


@pytest.mark.slow
@pytest.mark.timeout(SCENARIO_S + 60)
def test_lose_a_node_keep_training_grow_back(tmp_path: Path, straight: Path) -> None:  # noqa: F811 - the fixture
    run, gates = tmp_path / "elastic", tmp_path / "gates"
    gates.mkdir()
    port = free_port()
    deadline = time.monotonic() + SCENARIO_S
    agents = {"A": _agent("A", run, port, gates, host=True), "B": _agent("B", run, port, gates, host=False)}
    try:
        # Both nodes train at world size 2 up to step 4's checkpoint; B holds step 5 while A waits for it.
        _wait(lambda: (gates / f"B-{LOST_AT}.reached").exists(), deadline, "node B at step 5", agents, gates)
        assert (gates / f"B-{LOST_AT}.reached").read_text().split()[1] == "2", "the first rendezvous formed 2 nodes"
        os.killpg(agents["B"].pid, signal.SIGKILL)
        killed = time.time()
        agents["B"].wait(timeout=10)
        # A's worker fails fast, torchrun restarts it alone; it resumes and holds step 9 until a node joins.
        _wait(lambda: (gates / f"A-{JOINED_AT}.reached").exists(), deadline, "node A alone at step 9", agents, gates)
        assert (gates / f"A-{JOINED_AT}.reached").read_text().split()[1] == "1"
        agents["C"] = _agent("C", run, port, gates, host=False)
        for node in ("A", "C"):
            agents[node].wait(timeout=max(1.0, deadline - time.monotonic()))
            assert agents[node].returncode == 0, (gates / f"agent-{node}.log").read_text()[-4000:]
    finally:
        for agent in agents.values():
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait(timeout=10)

    # Failing fast: the survivor's worker raised within seconds of its peer's death, not at the timeout.
    logs = "".join(p.read_text() for p in sorted((run / "logs").glob("rank*.log")))
    failed = [_log_time(x) for x in logs.splitlines() if "training failed on rank" in x and _log_time(x) > killed]
    assert failed, "the surviving worker recorded its failure"
    detection_s = min(failed) - killed
    print(f"peer loss detected {detection_s:.2f} s after SIGKILL (trainer.collective_timeout_s=30)")
    assert detection_s < 30, "a peer's death is detected before the collective timeout"
    assert re.search(r"elastic restart 1 \(torchrun\): trainer.resume=auto is implied", logs)

    ref = {int(r["step"]): r for r in read_metrics(straight) if r["loss"]}
    got = {int(r["step"]): r for r in read_metrics(run) if r["loss"]}
    assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1))
    assert [got[s]["data_digest"] for s in got] == [ref[s]["data_digest"] for s in ref], (
        "no sample skipped or repeated across the shrink and the growth"
    )
    sizes = [int(got[s]["world_size"]) for s in sorted(got)]
    assert sizes == [2] * (LOST_AT - 1) + [1] * (JOINED_AT - LOST_AT + 1) + [2] * (STEPS - JOINED_AT), sizes
    # Adam's trajectory from the same samples in another reduction order: assert_close's fp32
    # defaults (tests/numerics.py), within 1e-5 relative for these losses (> 1).
    after = [LOST_AT, LOST_AT + 1, JOINED_AT + 1, JOINED_AT + 2]
    assert_trajectories([float(got[s]["loss"]) for s in after], [float(ref[s]["loss"]) for s in after], "elastic")
    assert all(abs(float(got[s]["loss"]) / float(ref[s]["loss"]) - 1) <= 1e-5 for s in after)

    rows = [r for r in json.loads(cli("lineage", str(run), "--json"))["rows"] if r["event"] == "restart"]
    details = [json.loads(r["detail"]) for r in rows]
    assert [(d["world_size_before"], d["world_size_after"], d["cause"]) for d in details] == [
        (2, 1, "node_lost"),
        (1, 2, "node_joined"),
    ], details
    assert details[0]["checkpoint"] == "checkpoints/step-4"
    assert details[1]["checkpoint"] == f"checkpoints/step-{JOINED_AT}-preempted", "the join went through a save"
    assert all(d.get("elastic_restart", 0) >= 1 for d in details)
