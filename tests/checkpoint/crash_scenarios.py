"""What the crash-point test runs: small runs of a ``CheckpointManager`` in one process, and the check after a crash.

Each scenario starts from a prepared run directory (``prepare``) and does one thing -- a save
with retention, a first save, a quarantine, a new chain, a fine-tune's first save -- which the
test runs in a child process (``child``) either tracing every crash point it reaches or ending
the process at one of them. ``recover`` is what the next run does, and checks what the product
promises after any crash, including that the resumed model and optimizer are bit for bit the
ones saved (each save carries a copy of them in its trainer state, stored apart from the model).

A scenario in the packed layout (``layout="packed"``) runs the same steps with the model sharded
by shardline's engine in a one-rank process group (its state dict holds DTensors, ``Replicate()`` on a one-rank mesh),
so its saves really pack: a table with entries, segment items in ``.metadata``.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import shardline
import shardline.checkpoint as ckpt
from shardline import cli
from shardline.checkpoint.faults import crashpoints
from shardline.checkpoint.format.packed_layout import is_segment_key, layout_of
from shardline.checkpoint.provenance.directory import read_latest, scan
from shardline.checkpoint.provenance.lineage import audit, start_new_chain
from shardline.checkpoint.provenance.retention import signature_path_for
from shardline.errors import LineageError

KEEP = 2  # keep_last_n of every manager here: the save scenario deletes one checkpoint


@dataclass(frozen=True)
class Scenario:
    name: str
    before: int | None  # newest step the next resume may fall back to (None: nothing to resume)
    saving: int  # the step the scenario saves
    kept: tuple[int, ...]  # regular steps that must still be committed after any crash
    source: str | None = None  # the fine-tune's source checkpoint, relative to the scenario root
    layout: str = "per_tensor"  # the managers' layout; "packed": the model under shardline's engine (one rank)
    action: str | None = None  # the scenario whose steps it runs (None: its own name)

    @property
    def does(self) -> str:
        return self.action or self.name


SCENARIOS = (
    Scenario("first_save", before=None, saving=1, kept=()),
    Scenario("save", before=2, saving=3, kept=(2,)),
    Scenario("quarantine", before=1, saving=2, kept=(1,)),
    Scenario("new_chain", before=2, saving=3, kept=(2,)),
    Scenario("finetune", before=None, saving=3, kept=(), source="source/checkpoints/step-2"),
    # The save and the quarantine again, every checkpoint packed: every point of a save, the ledger, latest and
    # retention on a packed checkpoint, and a damaged packed checkpoint moved aside.
    Scenario("packed_save", before=2, saving=3, kept=(2,), layout="packed", action="save"),
    Scenario("packed_quarantine", before=1, saving=2, kept=(1,), layout="packed", action="quarantine"),
)
BY_NAME = {s.name: s for s in SCENARIOS}
# Points only a checkpoint in an object store reaches: test_object_store_lifecycle.py crashes at each against a real
# server (the scenarios here run on a local disk).
STORE_POINTS = (
    "save.store_claimed",
    "save.store_uploaded",
    "save.store_metadata_copied",
    "save.store_claim_released",
    "recovery.store_cleared",
    "recovery.store_claim_removed",
    "retention.store_manifest_deleted",
    "retention.store_removed",
    "quarantine.store_copied",
    "quarantine.store_manifest_deleted",
    "quarantine.store_removed",
)


def one_rank_group() -> None:
    """A one-rank gloo process group for this process (a packed scenario's engine needs one), if none exists."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def end_group() -> None:
    """Destroy this process's group (the test process's, after its packed scenarios)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def _model(layout: str = "per_tensor") -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    if layout == "packed":
        one_rank_group()
        shardline.wrap(model, shardline.layer_policy(torch.nn.Linear), strategy="full_shard")
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def _tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Copies of every tensor of the model and the optimizer, whole: what a resume must restore bit for bit."""

    def whole(value: torch.Tensor) -> torch.Tensor:
        return (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()

    out = {f"model.{k}": whole(v) for k, v in model.state_dict().items()}
    for index, state in opt.state_dict()["state"].items():
        out |= {f"optim.{index}.{k}": whole(v) for k, v in state.items() if isinstance(v, torch.Tensor)}
    return out


def check_resumed(name: str, model: torch.nn.Module, opt: torch.optim.Optimizer, state: dict | None) -> None:
    """The model and optimizer a resume loaded are, bit for bit, those the checkpoint saved (:func:`_save` put a
    copy of them in its trainer state)."""
    if state is None:
        return
    saved, got = state["tensors"], _tensors(model, opt)
    assert sorted(saved) == sorted(got), f"{name}: resumed {sorted(got)}, saved {sorted(saved)}"
    differ = [k for k in saved if saved[k].dtype != got[k].dtype or not torch.equal(saved[k], got[k])]
    assert not differ, f"{name}: step {state['step']} resumed with tensors that differ from those saved: {differ}"


def check_packed(name: str, metadata_bytes: bytes, manifest: dict) -> None:
    """A packed scenario's checkpoint really packs: a table with entries, segments in .metadata, none of the
    packed tensors as an item of its own, and the manifest says so."""
    metadata = pickle.loads(metadata_bytes)
    layout = layout_of(metadata)
    assert layout is not None, f"{name}: no packed table in .metadata"
    assert layout.entries, f"{name}: the packed table is empty"
    stored = metadata.state_dict_metadata
    assert [k for k in stored if is_segment_key(k)], f"{name}: no segment in .metadata: {sorted(stored)}"
    assert not [e.key for e in layout.entries if e.key in stored], f"{name}: a packed tensor stored whole"
    assert manifest["sharding"]["layout"] == "packed", f"{name}: manifest sharding {manifest['sharding']}"


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    opt.zero_grad()


def _save(manager: ckpt.CheckpointManager, model, opt, step: int) -> None:
    _step(model, opt)
    state = {"step": step, "tensors": _tensors(model, opt)}
    manager.save(ckpt.SaveRequest(step=step, model=model, optimizer=opt, state=state, config={"lr": 0.1}))


def checkpoints(root: Path) -> Path:
    return root / "run" / "checkpoints"


def ledger_path(root: Path) -> Path:
    return root / "run" / "lineage.sqlite"


def manager(root: Path, layout: str = "per_tensor") -> ckpt.CheckpointManager:
    return ckpt.CheckpointManager(checkpoints(root), ledger_path=ledger_path(root), keep_last_n=KEEP, layout=layout)


def prepare(name: str, root: Path) -> None:
    """The run directory a scenario starts from, under ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    scenario = BY_NAME[name]
    does, layout = scenario.does, scenario.layout
    if does == "first_save":
        return
    if does == "finetune":
        source = ckpt.CheckpointManager(root / "source" / "checkpoints", layout=layout)
        model, opt = _model(layout)
        for step in (1, 2):
            _save(source, model, opt, step)
        return
    m = manager(root, layout)
    model, opt = _model(layout)
    for step in (1, 2):
        _save(m, model, opt, step)
    directory = checkpoints(root)
    if does == "save":
        signature_path_for(directory / "step-1").write_text("{}")  # retention deletes it with step-1
    elif does == "quarantine":
        data = directory / "step-2" / "__0_0.distcp"
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))
        signature_path_for(directory / "step-2").write_text("{}")  # moves aside with step-2
    elif does == "new_chain":
        ckpt.Ledger(ledger_path(root)).head_path.unlink()  # the chain no longer verifies: a new one is due


def act(name: str, root: Path) -> None:
    """The scenario's action (what a crash interrupts)."""
    scenario = BY_NAME[name]
    if scenario.does == "new_chain":
        ledger = ckpt.Ledger(ledger_path(root))
        start_new_chain(ledger, problems=list(audit(ledger).problems))
    m = manager(root, scenario.layout)
    model, opt = _model(scenario.layout)
    resume: str | os.PathLike = "auto" if scenario.source is None else root / scenario.source
    m.load(resume, model=model, optimizer=opt)
    _save(m, model, opt, scenario.saving)


def child(name: str, root: str, point: str | None, hit: int, trace_file: str | None) -> None:
    """Run in a child process: trace every crash point (``point`` None) or end the process at ``point``'s hit."""
    if point is None:
        crashpoints.trace()
    else:
        crashpoints.arm(point, hit=hit)
    act(name, Path(root))
    if trace_file is not None:
        Path(trace_file).write_text(json.dumps(crashpoints.traced()))


def recover(name: str, root: Path, *, may_redo_new_chain: bool) -> dict[str, object]:
    """What the next run does after a crash, checking that nothing was lost or reported tampered.

    Returns what it saw (for the test's messages). ``may_redo_new_chain``: the crash came before a
    new chain's commit point, so the chain is still the broken one and ``--new-chain`` is run again.
    """
    scenario = BY_NAME[name]
    directory = checkpoints(root)
    ledger = ckpt.Ledger(ledger_path(root))
    redone = False
    try:
        m = manager(root, scenario.layout)
    except LineageError as e:
        if not may_redo_new_chain:
            raise AssertionError(f"{name}: the next open failed: {e}") from e
        start_new_chain(ledger, problems=list(audit(ledger).problems))
        redone = True
        m = manager(root, scenario.layout)
    model, opt = _model(scenario.layout)
    state = m.load("auto", model=model, optimizer=opt)
    loaded = None if state is None else int(state["step"])
    check_resumed(name, model, opt, state)
    allowed = {scenario.before, scenario.saving}
    assert loaded in allowed, f"{name}: resumed step {loaded}, expected one of {sorted(allowed, key=str)}"
    quarantined = [p.name for p in m.moved_aside]
    if quarantined:
        assert scenario.does == "quarantine", f"{name}: moved aside {quarantined}"
        assert quarantined[0].startswith("step-2.damaged-"), quarantined
    committed = {c.step for c in scan(directory)[0] if c.tag is None}
    assert set(scenario.kept) <= committed, f"{name}: steps lost: {sorted(set(scenario.kept) - committed)}"
    if (directory / f"step-{scenario.saving}").is_dir() and scenario.saving in committed:
        assert loaded == scenario.saving, f"{name}: step-{scenario.saving} is committed but {loaded} was resumed"
    if ledger.path.is_file():
        report = audit(ledger)
        assert report.ok, f"{name}: the chain does not verify: {report.problems}"
        assert cli.main(["lineage", str(root / "run")]) == 0
    else:  # a crash before the first row: nothing may be committed then
        assert not committed, f"{name}: committed {sorted(committed)} but no ledger"
    latest = read_latest(directory)
    if committed:
        assert latest is not None, f"{name}: no latest"
        assert latest.is_dir(), f"{name}: latest names {latest}, which is not there"
        assert ckpt.verify_checkpoint(latest).ok, f"{name}: latest ({latest}) does not verify"
        if scenario.layout == "packed":
            check_packed(name, (latest / ".metadata").read_bytes(), json.loads((latest / "manifest.json").read_text()))
        assert latest == m.committed()[-1].path or m.committed()[-1].tag is not None
    parent = m.parent_manifest_hash
    _save(m, model, opt, scenario.saving + 10)  # training goes on, chained to what it resumed
    newest = next(r for r in reversed(ledger.rows()) if r.is_commit)
    assert newest.step == scenario.saving + 10
    assert newest.parent_manifest_sha256 == parent
    report = audit(ledger)
    assert report.ok, f"{name}: the chain does not verify after the next save: {report.problems}"
    leftovers = [p.name for p in directory.iterdir() if p.name.startswith(".")]
    assert not leftovers, f"{name}: leftovers after the next open and save: {leftovers}"
    return {"loaded": loaded, "redone": redone}


def context() -> multiprocessing.context.BaseContext:
    """The forkserver the children fork from: it imports torch and shardline once, so a child costs a fork.

    ``torch._dynamo`` too: the optimizer imports it lazily, which would cost each child a second.
    """
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(
        ["torch", "torch._dynamo", "torch.distributed.checkpoint", "shardline.checkpoint", __name__]
    )
    return ctx


def fork_and_wait(target, args: tuple, *, name: str, point: str | None, hit: int) -> int:
    """Run ``target(*args)`` in a forked process; its exit code (a hang past 60 s is killed and fails)."""
    proc = context().Process(target=target, args=args, daemon=True)
    proc.start()
    proc.join(timeout=60)
    if proc.is_alive():
        proc.kill()
        proc.join()
        raise AssertionError(f"{name}: the child crashed at {point} (hit {hit}) hung for 60 s")
    return int(proc.exitcode or 0)


def run_child(name: str, root: Path, point: str | None, hit: int = 1, trace_file: Path | None = None) -> int:
    """Run :func:`child` in a forked process; its exit code (a hang past 60 s fails)."""
    trace = str(trace_file) if trace_file else None
    return fork_and_wait(child, (name, str(root), point, hit, trace), name=name, point=point, hit=hit)


def copy_base(base: Path, root: Path) -> None:
    shutil.copytree(base, root, symlinks=True)


def hold_a_save(directory: str, ready_file: str) -> None:
    """Run in a child process: start a save (its temporary directory exists) and stay inside it until killed."""
    import time

    from shardline.checkpoint.lifecycle.save import preflight

    tmp = preflight(Path(directory) / "step-5")
    ready = Path(ready_file)
    ready.with_suffix(".part").write_text(str(tmp))
    ready.with_suffix(".part").rename(ready)
    time.sleep(120)


def start_holding_a_save(directory: Path, ready_file: Path) -> multiprocessing.process.BaseProcess:
    """:func:`hold_a_save` in a forked process; returns once its temporary directory exists."""
    import time

    proc = context().Process(target=hold_a_save, args=(str(directory), str(ready_file)), daemon=True)
    proc.start()
    deadline = time.monotonic() + 60
    while not ready_file.exists():
        assert proc.is_alive(), f"the saving process ended with {proc.exitcode} before its save started"
        assert time.monotonic() < deadline, "the saving process did not start its save within 60 s"
        time.sleep(0.05)
    return proc
