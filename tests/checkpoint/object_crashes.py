"""What the object-store crash-point test runs: a manager on a bucket prefix deleting (retention) or moving aside
(quarantine) a checkpoint, ended at one crash point in a forked child; and the check of what the next run sees.

The children are forked from the crash-point test's forkserver (:func:`.crash_scenarios.context`),
whose environment predates the test's server: endpoint and credentials are passed explicitly.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import shardline.checkpoint as ckpt
from shardline import cli
from shardline.checkpoint.faults import crashpoints
from shardline.checkpoint.provenance.directory import scan
from shardline.checkpoint.storage.objects import as_location
from tests.checkpoint import crash_scenarios as sc

KEEP = 2
# scenario -> (the steps saved before, the step the action saves, the steps that must survive any crash)
SCENARIOS = {"retention": ((1, 2), 3, (2,)), "quarantine": ((1, 2), 2, (1,))}


def manager(root: str, ledger: str, env: dict[str, str]) -> ckpt.CheckpointManager:
    return ckpt.CheckpointManager(
        root, ledger_path=ledger, keep_last_n=KEEP, storage_options={"endpoint_url": env["AWS_ENDPOINT_URL"]}
    )


def prepare(name: str, root: str, ledger: str, env: dict[str, str]) -> None:
    """Steps 1 and 2 committed under ``root``; for ``quarantine``, step-2's first shard then has a flipped byte."""
    Path(ledger).parent.mkdir(parents=True, exist_ok=True)
    m = manager(root, ledger, env)
    model, opt = sc._model()
    for step in SCENARIOS[name][0]:
        sc._save(m, model, opt, step)
    if name == "quarantine":
        fs = as_location(root).fs
        key = f"{root.removeprefix('s3://')}/step-2/__0_0.distcp"
        data = bytearray(fs.cat_file(key))
        data[len(data) // 2] ^= 0xFF
        fs.pipe_file(key, bytes(data))


def child(name: str, root: str, ledger: str, env: dict[str, str], point: str | None, hit: int, trace: str) -> None:
    """In a forked child: resume ``auto`` and save the scenario's step, tracing every point or crashing at one."""
    os.environ.update(env)
    if point is None:
        crashpoints.trace()
    else:
        crashpoints.arm(point, hit=hit)
    m = manager(root, ledger, env)
    model, opt = sc._model()
    m.load("auto", model=model, optimizer=opt)
    sc._save(m, model, opt, SCENARIOS[name][1])
    if point is None:
        Path(trace).write_text(json.dumps(crashpoints.traced()))


def run_child(name: str, root: str, ledger: str, env: dict[str, str], point: str | None, hit: int, trace: str) -> int:
    return sc.fork_and_wait(child, (name, root, ledger, env, point, hit, trace), name=name, point=point, hit=hit)


def recover(name: str, root: str, ledger: str, env: dict[str, str]) -> None:
    """The next run after a crash: nothing lost, no second row, no second move, no leftover prefix; training goes on."""
    _, saving, kept = SCENARIOS[name]
    m = manager(root, ledger, env)
    model, opt = sc._model()
    state = m.load("auto", model=model, optimizer=opt)
    loaded = None if state is None else int(state["step"])
    assert loaded in {*kept, saving}, f"{name}: resumed step {loaded}"
    assert not m.moved_aside, f"{name}: moved aside again on the next run: {m.moved_aside}"
    committed = {c.step for c in scan(as_location(root))[0]}
    assert set(kept) <= committed, f"{name}: steps lost: {sorted(set(kept) - committed)}"
    sc._save(m, model, opt, saving + 10)  # its retention finishes an interrupted deletion
    rows = ckpt.Ledger(Path(ledger)).rows()
    fs = as_location(root).fs
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root.removeprefix("s3://")))
    if name == "retention":
        buried = [r.checkpoint for r in rows if r.event == "tombstone"]
        assert f"{root}/step-1" in buried, f"{name}: tombstones {buried}"
        assert len(buried) == len(set(buried)), f"{name}: a second tombstone {buried}"
        assert "step-1" not in names, f"{name}: step-1's prefix is left: {names}"
    else:
        [row] = [r for r in rows if r.event == "quarantine"]
        moved_to = json.loads(row.detail or "{}")["moved_to"]
        aside = [n for n in names if n.startswith("step-2.damaged-")]
        assert [f"{root}/{n}" for n in aside] == [moved_to], f"{name}: one aside prefix, the recorded one: {names}"
        assert fs.isfile(f"{moved_to.removeprefix('s3://')}/manifest.json"), f"{name}: the aside copy is whole"
        if saving not in committed:
            assert "step-2" not in names, f"{name}: the damaged step-2 is left: {names}"
    report = ckpt.Ledger(Path(ledger)).verify()
    assert report.ok, f"{name}: {report.problems}"
    assert cli.main(["lineage", str(Path(ledger).parent)]) == 0
