"""What a crashed or interrupted save into a bucket leaves, and how the next run goes on: against the session
SeaweedFS server.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import shardline.checkpoint as ckpt
from shardline import cli
from shardline.checkpoint.faults.crashpoints import CRASH_EXIT_CODE
from shardline.checkpoint.format.canonical import canonical_json
from shardline.checkpoint.storage import claims as claim_module
from shardline.checkpoint.storage.claims import MAX_CLAIM_AGE, Claim, judge
from shardline.errors import CheckpointExistsError
from tests.checkpoint import crash_scenarios as sc
from tests.checkpoint import object_crashes
from tests.checkpoint.conftest import S3_BUCKET
from tests.checkpoint.s3_proxy import FaultProxy
from tests.checkpoint.seaweed import S3Server

pytestmark = pytest.mark.timeout(120)


def _prefix() -> str:
    return f"s3://{S3_BUCKET}/{uuid.uuid4().hex[:12]}"


def _keys(server: S3Server, root: str) -> list[str]:
    key = root.removeprefix("s3://")
    return sorted(k[len(key) + 1 :] for k in server.filesystem().find(key))


def _uploads(server: S3Server, root: str) -> list[str]:
    bucket, key = root.removeprefix("s3://").split("/", 1)
    found = server.filesystem().call_s3("list_multipart_uploads", Bucket=bucket, Prefix=key + "/")
    return sorted(u["Key"] for u in found.get("Uploads", []))


@pytest.fixture
def proxy(s3_env: S3Server) -> Iterator[FaultProxy]:
    """A fault-injecting proxy in front of the session's server (see s3_proxy.py)."""
    with FaultProxy(s3_env.endpoint) as p:
        yield p


def test_a_save_killed_before_its_manifest_is_cleared_by_the_next_run(
    s3_env: S3Server, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Step 2's rank 0 ends (os._exit) after every object and .metadata are up, before the manifest, while a
    multipart upload it began is still open: the next manager clears the prefix, its claim and the upload (and
    logs what it cleared), resumes step 1, and saving step 2 again commits."""
    root, ledger = _prefix(), str(tmp_path / "run" / "lineage.sqlite")
    Path(ledger).parent.mkdir()
    code = object_crashes.run_killed_save(root, ledger, s3_env.env, [1, 2], "save.sums_written")
    assert code == CRASH_EXIT_CODE
    left = _keys(s3_env, root)
    assert "step-2/.metadata" in left, left
    assert "step-2/manifest.json" not in left, left
    assert any("shardline-claim" in k for k in left), f"the killed save's claim is there: {left}"
    bucket, key = root.removeprefix("s3://").split("/", 1)
    fs = s3_env.filesystem()
    upload = fs.call_s3("create_multipart_upload", Bucket=bucket, Key=f"{key}/step-2/__0_1.distcp")
    fs.call_s3(
        "upload_part", Bucket=bucket, Key=f"{key}/step-2/__0_1.distcp", UploadId=upload["UploadId"], PartNumber=1,
        Body=b"x" * 1024,
    )  # fmt: skip
    assert _uploads(s3_env, root) == [f"{key}/step-2/__0_1.distcp"]

    with caplog.at_level(logging.INFO, logger="shardline"):
        m = object_crashes.manager(root, ledger, s3_env.env)
    model, opt = sc._model()
    state = m.load("auto", model=model, optimizer=opt)
    assert state is not None
    assert int(state["step"]) == 1
    m.check_free([2, 3])
    sc._save(m, model, opt, 2)
    assert ckpt.verify_checkpoint(f"{root}/step-2").ok
    assert _uploads(s3_env, root) == [], "the killed writer's multipart upload is aborted"
    assert not [k for k in _keys(s3_env, root) if "shardline-claim" in k], "no claim is left behind"
    [record] = [r.getMessage() for r in caplog.records if "did not commit" in r.getMessage()]
    assert f"{root}/step-2," in record, record
    assert "its claim step-2.shardline-claim removed" in record, record
    assert "1 multipart upload(s) aborted" in record, record
    rows = ckpt.Ledger(Path(ledger)).rows()
    assert [(r.step, r.recovered) for r in rows if r.is_commit] == [(1, False), (2, False)]
    assert cli.main(["lineage", str(Path(ledger).parent)]) == 0


_NOW = datetime.datetime(2026, 1, 2, 12, 0, tzinfo=datetime.timezone.utc)


def _claim(*, host: str | None = None, pid: int | None = None, run: str | None = None) -> Claim:
    here = host is None
    return Claim(
        host=socket.gethostname() if here else host,
        pid=os.getpid() if pid is None else pid,
        nonce="0123456789abcdef",
        checkpoint="s3://b/run/step-3",
        run=run,
        pidns=os.readlink("/proc/self/ns/pid") if here else None,
    )


def test_a_claim_is_stale_only_when_no_live_save_can_hold_it() -> None:
    """The rule of claim.judge, case by case: this host's claims by their pid (dead, reused, alive, this process's
    with and without a save under way), this run's from another host (a restart elsewhere), anyone's past the age
    bound, an unreadable one after a minute."""
    young, old = _NOW - datetime.timedelta(minutes=5), _NOW - MAX_CLAIM_AGE - datetime.timedelta(minutes=1)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, check=True)
    dead_pid = int(gone.stdout)
    assert "no longer running" in judge(_claim(pid=dead_pid), young, run=None, now=_NOW)
    # A running process that started before the claim holds it; one that started after it reuses its pid.
    parent = os.getppid()
    assert judge(_claim(pid=parent), datetime.datetime.now(datetime.timezone.utc), run="r") is None
    assert "pid reused" in judge(_claim(pid=parent), _NOW - datetime.timedelta(days=3650), run=None, now=_NOW)
    # This process's own claim is live while one of its saves is under way there, stale after.
    mine = _claim()
    assert "ended without removing it" in judge(mine, young, run=None, now=_NOW)
    claim_module._SAVING.add(mine.checkpoint)
    try:
        assert judge(mine, young, run=None, now=_NOW) is None
    finally:
        claim_module._SAVING.discard(mine.checkpoint)
    # Another host: this run's claim is a dead incarnation's; another run's young one may be live; old ones are not.
    assert "this run's" in judge(_claim(host="node-7", pid=1, run="/runs/a#ab"), young, run="/runs/a#ab", now=_NOW)
    assert judge(_claim(host="node-7", pid=1, run="/runs/b#cd"), young, run="/runs/a#ab", now=_NOW) is None
    assert judge(_claim(host="node-7", pid=1, run=None), young, run=None, now=_NOW) is None
    assert "older than" in judge(_claim(host="node-7", pid=1, run="/runs/b#cd"), old, run="/runs/a#ab", now=_NOW)
    # Same host name, another pid namespace (a container): the pid says nothing here.
    other_ns = Claim(host=socket.gethostname(), pid=dead_pid, nonce="x", checkpoint="c", pidns="pid:[1]")
    assert judge(other_ns, young, run=None, now=_NOW) is None
    # A claim written by an earlier version (no namespace, kept inside the prefix): its host and pid decide.
    legacy = Claim(host=socket.gethostname(), pid=dead_pid, nonce="x", checkpoint="c")
    assert "no longer running" in judge(legacy, young, run=None, now=_NOW)
    assert judge(None, _NOW - datetime.timedelta(seconds=10), run=None, now=_NOW) is None
    assert "not one shardline wrote" in judge(None, young, run=None, now=_NOW)
    assert Claim.parse(b"not json") is None
    assert Claim.parse(canonical_json(_claim().__dict__)) == _claim()


def test_a_live_claim_is_left_and_named_and_a_restarted_runs_own_is_cleared(s3_env: S3Server, tmp_path: Path) -> None:
    """Another run's young claim from another host is left on open, and check_free and the save of that step name
    its host and pid; the same claim naming this run (its ledger: a restart on another node) is cleared on the
    next open, and the step saves; so is a claim an earlier version kept inside the prefix, of a dead process."""
    root, ledger = _prefix(), str(tmp_path / "lineage.sqlite")
    m = object_crashes.manager(root, ledger, s3_env.env)
    model, opt = sc._model()
    sc._save(m, model, opt, 1)
    fs, key = s3_env.filesystem(), root.removeprefix("s3://")
    other = {"host": "node-7", "pid": 4242, "nonce": "feedfacefeedface", "checkpoint": f"{root}/step-2"}
    fs.pipe_file(f"{key}/step-2.shardline-claim", canonical_json({**other, "run": "/elsewhere/lineage.sqlite"}))
    fs.pipe_file(f"{key}/step-2/__0_0.distcp", b"partial")
    m = object_crashes.manager(root, ledger, s3_env.env)
    assert fs.exists(f"{key}/step-2/__0_0.distcp"), "a claim that may be live is left with its prefix"
    with pytest.raises(CheckpointExistsError, match=r"another run is saving: .*host node-7, pid 4242"):
        m.check_free([2])
    with pytest.raises(CheckpointExistsError, match=r"being saved by another run: .*host node-7, pid 4242"):
        sc._save(m, model, opt, 2)

    run = f"{Path(ledger).absolute()}#{ckpt.Ledger(Path(ledger)).rows()[0].row_sha256}"
    fs.pipe_file(f"{key}/step-2.shardline-claim", canonical_json({**other, "run": run}))
    fs.pipe_file(f"{key}/step-2/__0_0.distcp", b"partial")
    m = object_crashes.manager(root, ledger, s3_env.env)
    assert object_crashes.leftovers(root) == []
    m.check_free([2])
    sc._save(m, model, opt, 2)
    assert ckpt.verify_checkpoint(f"{root}/step-2").ok

    # A save by an earlier version kept its claim inside the prefix; a dead process of this host left this one.
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, check=True)
    legacy = {"host": socket.gethostname(), "pid": int(gone.stdout), "nonce": "0", "checkpoint": f"{root}/step-3"}
    fs.pipe_file(f"{key}/step-3/.shardline-claim", canonical_json(legacy))
    fs.pipe_file(f"{key}/step-3/.metadata", b"partial")
    m = object_crashes.manager(root, ledger, s3_env.env)
    assert object_crashes.leftovers(root) == []
    sc._save(m, model, opt, 3)


@pytest.mark.parametrize("target", [".shardline-claim", "/manifest.json"])
def test_a_conditional_put_whose_response_is_lost_is_known_as_ours(
    s3_env: S3Server, proxy: FaultProxy, tmp_path: Path, target: str
) -> None:
    """The proxy forwards the claim's (or the manifest's) ``If-None-Match: *`` PUT to the server, then closes the
    client's connection without the response; the client retries and gets 412. The save reads the object back,
    finds its own bytes, and commits: one commit row (not a recovered one), no claim left, the chain verifies."""
    root, ledger = _prefix(), str(tmp_path / "lineage.sqlite")
    m = object_crashes.manager(root, ledger, s3_env.env, endpoint_url=proxy.endpoint)
    model, opt = sc._model()
    sc._save(m, model, opt, 1)
    proxy.reset()
    proxy.inject("lose", lambda r: r.kind == "put-if-none-match" and r.key.endswith(target))
    sc._save(m, model, opt, 2)
    outcomes = [o for r, o in proxy.seen if r.kind == "put-if-none-match" and r.key.endswith(target)]
    assert outcomes == ["lost", "412"], proxy.seen
    assert ckpt.verify_checkpoint(f"{root}/step-2").ok
    rows = ckpt.Ledger(Path(ledger)).rows()
    assert [(r.step, r.recovered) for r in rows if r.is_commit] == [(1, False), (2, False)]
    assert object_crashes.leftovers(root) == []
    assert cli.main(["lineage", str(tmp_path)]) == 0
