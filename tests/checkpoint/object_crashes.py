"""What the object-store crash-point test runs: a manager on a bucket prefix saving a step (its claim, uploads,
manifest, ledger row, then retention's deletion), moving a damaged checkpoint aside (quarantine), or clearing a
save that died before its manifest, ended at one crash point in a forked child; and the check of what the next run
sees.

The children are forked from the crash-point test's forkserver (:func:`.crash_scenarios.context`),
whose environment predates the test's server: endpoint and credentials are passed explicitly.

``packed_save`` is ``save`` with every checkpoint in the packed layout (the model under shardline's
engine in a one-rank group: :func:`.crash_scenarios._model`), crashed at the points of the save where
its data is uploaded but not committed, and at its commit.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import shardline.checkpoint as ckpt
from shardline import cli
from shardline.checkpoint.faults import crashpoints
from shardline.checkpoint.provenance.directory import scan
from shardline.checkpoint.storage.objects import as_location
from tests.checkpoint import crash_scenarios as sc

KEEP = 2


@dataclass(frozen=True)
class Scenario:
    before: tuple[int, ...]  # the steps saved (committed) before the action
    saving: int  # the step the action saves
    kept: tuple[int, ...]  # the steps that must survive any crash
    crash_at: tuple[str, ...]  # the points (by prefix) the test ends the action at, every time each is reached
    layout: str = "per_tensor"  # the managers' layout


SCENARIOS = {
    # resume step 2, save step 3 (claim, uploads, manifest, claim released, ledger row), retention deletes step 1
    "save": Scenario((1, 2), 3, (2,), ("save.", "ledger.", "retention.")),
    # resume=auto finds step 2 damaged, moves it aside, resumes step 1, saves step 2 again
    "quarantine": Scenario((1, 2), 2, (1,), ("quarantine.",)),
    # step 3's save died before its manifest; the next open clears its prefix and claim, then saves step 3
    "leftover": Scenario((1, 2), 3, (2,), ("recovery.",)),
    # "save" in the packed layout, ended where its data is in the bucket but not committed (shard and .metadata.tmp
    # uploaded, .metadata copied) and at its commit (the next run resumes it); the claim's, the records', the
    # ledger's and retention's points do not look at the data files: "save" covers them
    "packed_save": Scenario(
        (1, 2), 3, (2,), ("save.store_uploaded", "save.store_metadata_copied", "save.committed"), layout="packed"
    ),
}


def manager(
    root: str, ledger: str, env: dict[str, str], *, layout: str = "per_tensor", **options: object
) -> ckpt.CheckpointManager:
    return ckpt.CheckpointManager(
        root,
        ledger_path=ledger,
        keep_last_n=KEEP,
        storage_options={"endpoint_url": env["AWS_ENDPOINT_URL"], **options},
        layout=layout,
    )


def prepare(name: str, root: str, ledger: str, env: dict[str, str]) -> None:
    """Steps 1 and 2 committed under ``root``; for ``quarantine``, step-2's first shard then has a flipped byte;
    for ``leftover``, a save of step 3 then dies (in a child) after its uploads, before its manifest."""
    Path(ledger).parent.mkdir(parents=True, exist_ok=True)
    layout = SCENARIOS[name].layout
    m = manager(root, ledger, env, layout=layout)
    model, opt = sc._model(layout)
    for step in SCENARIOS[name].before:
        sc._save(m, model, opt, step)
    if name == "quarantine":
        fs = as_location(root).fs
        key = f"{root.removeprefix('s3://')}/step-2/shards/0000/__0_0.distcp"
        data = bytearray(fs.cat_file(key))
        data[len(data) // 2] ^= 0xFF
        fs.pipe_file(key, bytes(data))
    elif name == "leftover":
        code = run_killed_save(root, ledger, env, [3], "save.sums_written")
        assert code == crashpoints.CRASH_EXIT_CODE, f"the save left behind exited with {code}"
        left = as_location(root).fs.find(f"{root.removeprefix('s3://')}/step-3/shards/0000")
        assert left, "the save left behind wrote its data files under shards/ (key_prefixes.py)"


def child(name: str, root: str, ledger: str, env: dict[str, str], point: str | None, hit: int, trace: str) -> None:
    """In a forked child: resume ``auto`` and save the scenario's step, tracing every point or crashing at one."""
    os.environ.update(env)
    if point is None:
        crashpoints.trace()
    else:
        crashpoints.arm(point, hit=hit)
    act(name, root, ledger, env)
    if point is None:
        Path(trace).write_text(json.dumps(crashpoints.traced()))


def act(name: str, root: str, ledger: str, env: dict[str, str], **options: object) -> None:
    """The scenario's action: a manager opens, resumes ``auto`` and saves the scenario's step. ``options`` go to
    the file system (a test's endpoint through a proxy)."""
    layout = SCENARIOS[name].layout
    m = manager(root, ledger, env, layout=layout, **options)
    model, opt = sc._model(layout)
    m.load("auto", model=model, optimizer=opt)
    sc._save(m, model, opt, SCENARIOS[name].saving)


def run_child(name: str, root: str, ledger: str, env: dict[str, str], point: str | None, hit: int, trace: str) -> int:
    return sc.fork_and_wait(child, (name, root, ledger, env, point, hit, trace), name=name, point=point, hit=hit)


def killed_save(root: str, ledger: str, env: dict[str, str], steps: list[int], point: str) -> None:
    """In a forked child: save ``steps`` through a manager; the last one ends the process at ``point``."""
    os.environ.update(env)
    m = manager(root, ledger, env)
    model, opt = sc._model()
    for step in steps[:-1]:
        sc._save(m, model, opt, step)
    crashpoints.arm(point)
    sc._save(m, model, opt, steps[-1])


def run_killed_save(root: str, ledger: str, env: dict[str, str], steps: list[int], point: str) -> int:
    """:func:`killed_save` in a forked child; its exit code."""
    return sc.fork_and_wait(killed_save, (root, ledger, env, steps, point), name="killed save", point=point, hit=1)


def leftovers(root: str) -> list[str]:
    """What in ``root`` is neither a committed checkpoint nor an aside copy: claims, prefixes without a manifest,
    multipart uploads in progress."""
    fs = as_location(root).fs
    key = root.removeprefix("s3://")
    found = [p.rsplit("/", 1)[-1] for p in fs.ls(key, detail=False) if p.endswith(".shardline-claim")]
    for child in fs.ls(key, detail=False):
        name = child.rsplit("/", 1)[-1]
        if name.startswith("step-") and "." not in name and not fs.isfile(f"{child}/manifest.json"):
            found.append(f"{name}/ (no manifest: {sorted(p.rsplit('/', 1)[-1] for p in fs.find(child))})")
    bucket, prefix = key.split("/", 1)
    uploads = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix + "/").get("Uploads") or []
    return found + [f"multipart upload of {u['Key']}" for u in uploads]


def recover(name: str, root: str, ledger: str, env: dict[str, str], **options: object) -> int | None:
    """The next run after a crash: it opens and resumes ``auto``; nothing committed is lost, nothing is moved aside
    again or reported tampered; the step being saved, if it did not commit, is saved again (a prefix the crash left
    never blocks it); no claim, uncommitted prefix or upload is left; the chain verifies. Returns the step resumed.
    ``options`` go to the file system (a test's endpoint through a proxy).
    """
    scenario = SCENARIOS[name]
    m = manager(root, ledger, env, layout=scenario.layout, **options)
    model, opt = sc._model(scenario.layout)
    state = m.load("auto", model=model, optimizer=opt)
    loaded = None if state is None else int(state["step"])
    assert loaded in {*scenario.kept, scenario.saving}, f"{name}: resumed step {loaded}"
    sc.check_resumed(name, model, opt, state)
    assert not m.moved_aside, f"{name}: moved aside on the next run: {m.moved_aside}"
    committed = {c.step for c in scan(as_location(root))[0]}
    assert set(scenario.kept) <= committed, f"{name}: steps lost: {sorted(set(scenario.kept) - committed)}"
    for c in scan(as_location(root))[0]:
        report = ckpt.verify_checkpoint(str(c.path), storage_options=options or None)
        assert report.ok, f"{name}: {c.path} reported damaged: {report.to_json()}"
        if scenario.layout == "packed":
            prefix = str(c.path).removeprefix("s3://")
            fs = as_location(root).fs
            sc.check_packed(
                name, fs.cat_file(f"{prefix}/.metadata"), json.loads(fs.cat_file(f"{prefix}/manifest.json"))
            )
    if loaded != scenario.saving:
        m.check_free([scenario.saving])
        sc._save(m, model, opt, scenario.saving)  # the step the crash interrupted: nothing it left blocks it
    sc._save(m, model, opt, scenario.saving + 10)  # its retention finishes an interrupted deletion
    assert not leftovers(root), f"{name}: left behind: {leftovers(root)}"
    rows = ckpt.Ledger(Path(ledger)).rows()
    fs = as_location(root).fs
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root.removeprefix("s3://")))
    buried = [r.checkpoint for r in rows if r.event == "tombstone"]
    assert f"{root}/step-1" in buried or name == "quarantine", f"{name}: tombstones {buried}"
    assert len(buried) == len(set(buried)), f"{name}: a second tombstone {buried}"
    if name == "quarantine":
        [row] = [r for r in rows if r.event == "quarantine"]
        moved_to = json.loads(row.detail or "{}")["moved_to"]
        aside = [n for n in names if n.startswith("step-2.damaged-")]
        assert [f"{root}/{n}" for n in aside] == [moved_to], f"{name}: one aside prefix, the recorded one: {names}"
        assert fs.isfile(f"{moved_to.removeprefix('s3://')}/manifest.json"), f"{name}: the aside copy is whole"
    else:
        assert "step-1" not in names, f"{name}: step-1's prefix is left: {names}"
    report = ckpt.Ledger(Path(ledger)).verify()
    assert report.ok, f"{name}: {report.problems}"
    assert cli.main(["lineage", str(Path(ledger).parent)]) == 0
    return loaded
