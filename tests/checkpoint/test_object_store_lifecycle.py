"""The manager's lifecycle in an object store, against the session SeaweedFS server: retention (``keep_last_n``)
with tombstones, async saves, two runs on one prefix, an interrupted quarantine finished, a lost server named.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import pytest

import shardline.checkpoint as ckpt
from shardline import cli
from shardline.checkpoint.faults.crashpoints import CRASH_EXIT_CODE
from shardline.checkpoint.provenance.directory import scan
from shardline.checkpoint.storage.objects import as_location
from shardline.errors import CheckpointExistsError
from shardline.testing import run_distributed
from tests.checkpoint import crash_scenarios as sc
from tests.checkpoint import object_crashes, object_ranks, ranks
from tests.checkpoint.conftest import S3_BUCKET
from tests.checkpoint.crash_scenarios import STORE_POINTS
from tests.checkpoint.s3_proxy import FaultProxy
from tests.checkpoint.seaweed import S3Server
from tests.checkpoint.test_reshard import _assert_equal

pytestmark = pytest.mark.timeout(120)


def _prefix() -> str:
    return f"s3://{S3_BUCKET}/{uuid.uuid4().hex[:12]}"


def _names(server: S3Server, root: str) -> list[str]:
    return sorted(p.rsplit("/", 1)[-1] for p in server.filesystem().ls(root.removeprefix("s3://")))


def test_keep_last_n_on_a_bucket_tombstones_then_deletes(s3_env: S3Server, tmp_path: Path) -> None:
    root, ledger = _prefix(), str(tmp_path / "lineage.sqlite")
    latest, _ = run_distributed(
        object_ranks.manager_saves, 2, args=(root, ledger, [1, 2, 3, 4], 2), timeout=100, env=s3_env.env
    )[0]
    assert latest == [f"{root}/step-{n}" for n in (1, 2, 3, 4)]
    assert _names(s3_env, root) == ["step-3", "step-4"], "only the newest 2, and no leftover prefix"
    assert [c.path.name for c in scan(as_location(root))[0]] == ["step-3", "step-4"]
    rows = ckpt.Ledger(Path(ledger)).rows()
    buried = [r for r in rows if r.event == "tombstone"]
    assert [(r.step, r.checkpoint) for r in buried] == [(1, f"{root}/step-1"), (2, f"{root}/step-2")]
    commits = {r.checkpoint: r for r in rows if r.is_commit}
    for row in buried:
        detail = json.loads(row.detail or "{}")
        assert row.manifest_sha256 == commits[row.checkpoint].manifest_sha256
        assert detail["keep_last_n"] == 2
        assert detail["provenance"]["subject"], "the statement is copied into the tombstone"
        assert detail["provenance_sha256"]
        assert detail["files"] >= 2
    assert cli.main(["lineage", str(tmp_path)]) == 0


def test_async_saves_into_a_bucket_resume_the_state_saved(s3_env: S3Server, tmp_path: Path) -> None:
    """Async (host staging, the upload in the background, one more step trained meanwhile) with retention: the
    resumed state is the one staged at the save, bit for bit, as a synchronous save gives."""
    root, ledger = _prefix(), str(tmp_path / "lineage.sqlite")
    latest, staged = run_distributed(
        object_ranks.manager_saves, 2, args=(root, ledger, [1, 2], 2, True), timeout=100, env=s3_env.env
    )[0]
    assert latest == [f"{root}/step-1", f"{root}/step-2"]
    assert _names(s3_env, root) == ["step-2", "step-3"]
    step, resumed = run_distributed(
        object_ranks.manager_resume_state, 1, args=(root, ledger), timeout=100, env=s3_env.env
    )[0]
    assert step == 3
    _assert_equal(ranks.unpack(staged), ranks.unpack(resumed))
    assert ckpt.Ledger(Path(ledger)).verify().ok


def test_a_store_refusing_writes_is_named_in_async_mode_too(s3_env: S3Server, tmp_path: Path) -> None:
    """Credentials that may list but not write: a sync and an async save end with the same one line naming the
    endpoint (the save's first write, its claim on the prefix, is refused before any upload); nothing committed,
    nothing recorded."""
    root = _prefix()
    readonly = s3_env.storage_options(readonly=True)
    for async_save in (False, True):
        ledger = str(tmp_path / f"lineage-{async_save}.sqlite")
        results = run_distributed(
            object_ranks.try_manager_save, 2, args=(root, ledger, readonly, async_save), timeout=100, env=s3_env.env
        )
        for kind, message in results:
            assert kind == "CheckpointError", message
            assert message.startswith(f"the object store at {s3_env.endpoint} refused writing checkpoint {root}/step-1")
            assert "nothing was committed" in message
            assert "\n" not in message
        assert not Path(ledger).is_file() or not [r for r in ckpt.Ledger(Path(ledger)).rows() if r.is_commit]
    assert not s3_env.filesystem().exists(f"{root.removeprefix('s3://')}/step-1/manifest.json")


@pytest.mark.timeout(400)
def test_a_crash_at_each_point_of_the_bucket_protocol_is_survived(s3_env: S3Server, tmp_path: Path) -> None:
    """A save into the bucket (claim, uploads, .metadata, manifest, claim released, ledger row, retention's
    tombstone and deletion), ``resume=auto`` moving a damaged step-2 aside, and an open clearing a save that died
    before its manifest, each ended at every crash point of its part (every time it is reached) in a forked child;
    the next run resumes without losing a committed step, reports nothing tampered, saves the interrupted step
    again, finishes the same deletion or move (no second tombstone, no second aside copy), leaves no claim,
    uncommitted prefix or upload, ``shardline lineage`` passes, and the resumed state is bit for bit the one saved.
    The save runs again with every checkpoint packed (a non-empty table), ended where its data is uploaded but not
    committed and at its commit. Fails if a bucket-only point is reached by no scenario."""
    covered: dict[str, int] = {}
    spent: dict[str, str] = {}
    for name, scenario in object_crashes.SCENARIOS.items():
        begun, before = time.monotonic(), sum(covered.values())
        try:
            trace = tmp_path / f"{name}-trace.json"
            root, ledger = _prefix(), str(tmp_path / f"{name}-trace" / "lineage.sqlite")
            object_crashes.prepare(name, root, ledger, s3_env.env)
            assert object_crashes.run_child(name, root, ledger, s3_env.env, None, 1, str(trace)) == 0
            object_crashes.recover(name, root, ledger, s3_env.env)
            seen: dict[str, int] = {}
            for point in json.loads(trace.read_text()):
                seen[point] = seen.get(point, 0) + 1
                if not point.startswith(scenario.crash_at):
                    continue
                hit = seen[point]
                root, ledger = _prefix(), str(tmp_path / f"{name}-{point}-{hit}" / "lineage.sqlite")
                object_crashes.prepare(name, root, ledger, s3_env.env)
                code = object_crashes.run_child(name, root, ledger, s3_env.env, point, hit, "")
                assert code == CRASH_EXIT_CODE, f"{name}: crash at {point} (hit {hit}) exited with {code}"
                object_crashes.recover(name, root, ledger, s3_env.env)
                covered[point] = covered.get(point, 0) + 1
            spent[name] = f"{sum(covered.values()) - before} in {time.monotonic() - begun:.1f} s"
        finally:
            sc.end_group()  # a packed scenario's one-rank group in this process
    print(f"\nbucket crash points: {sum(covered.values())} crashes ({spent}): {sorted(covered.items())}")
    assert set(STORE_POINTS) <= set(covered), f"points no bucket scenario reaches: {set(STORE_POINTS) - set(covered)}"


def test_two_runs_saving_into_one_prefix_commit_once(s3_env: S3Server) -> None:
    """Two concurrent savers of the same step-N (two runs given one checkpoint.dir), started together: exactly one
    commits, the other stops with CheckpointExistsError naming the prefix, and the committed checkpoint is whole."""
    roots = [_prefix() for _ in range(3)]
    per_rank = run_distributed(object_ranks.race_to_save, 2, args=(roots,), timeout=100, env=s3_env.env)
    for i, root in enumerate(roots):
        outcomes = [per_rank[rank][i] for rank in (0, 1)]
        winners = [o for o in outcomes if o[0] == "ok"]
        losers = [o for o in outcomes if o[0] != "ok"]
        assert len(winners) == 1, outcomes
        [(kind, message, _)] = losers
        assert kind == "CheckpointExistsError", message
        assert f"{root}/step-1" in message
        report = ckpt.verify_checkpoint(f"{root}/step-1")
        assert report.ok, report.to_json()
        assert report.manifest_hash == winners[0][2], "the checkpoint is the winner's, untouched by the loser"
        assert not s3_env.filesystem().exists(f"{root.removeprefix('s3://')}/step-1.shardline-claim")

    # The commit record itself is conditional: a second manifest over a committed one is refused by the store.
    manifest = as_location(f"{roots[0]}/step-1") / "manifest.json"
    before = manifest.read_bytes()
    with pytest.raises(FileExistsError):
        manifest.write_new(b"{}")
    assert manifest.read_bytes() == before


VERSIONED_BUCKET = "shardline-versioned"


def test_retention_in_a_versioned_bucket_deletes_every_version(s3_env: S3Server, tmp_path: Path) -> None:
    """In a bucket with versioning enabled, a plain delete only adds a delete marker and frees nothing. After three
    saves with keep_last_n=1, nothing is left under the prefix but step-3's current objects: no noncurrent version
    of the deleted checkpoints (or of a claim, or of DCP's .metadata.tmp) and no delete marker."""
    fs = s3_env.filesystem()
    if not fs.exists(VERSIONED_BUCKET):
        fs.mkdir(VERSIONED_BUCKET)
        fs.call_s3(
            "put_bucket_versioning", Bucket=VERSIONED_BUCKET, VersioningConfiguration={"Status": "Enabled"}
        )  # fmt: skip
    key = uuid.uuid4().hex[:12]
    root, ledger = f"s3://{VERSIONED_BUCKET}/{key}", str(tmp_path / "lineage.sqlite")
    m = ckpt.CheckpointManager(root, ledger_path=ledger, keep_last_n=1)
    model, opt = sc._model()
    for step in (1, 2, 3):
        sc._save(m, model, opt, step)
    found = fs.call_s3("list_object_versions", Bucket=VERSIONED_BUCKET, Prefix=key + "/")
    markers = [d["Key"] for d in found.get("DeleteMarkers") or []]
    noncurrent = [v["Key"] for v in found.get("Versions") or [] if not v["IsLatest"]]
    current = sorted(v["Key"][len(key) + 1 :] for v in found.get("Versions") or [] if v["IsLatest"])
    assert markers == [], f"delete markers left: {markers}"
    assert noncurrent == [], f"noncurrent versions left (bytes still stored): {noncurrent}"
    assert {k.split("/")[0] for k in current} == {"step-3"}, current
    assert ckpt.verify_checkpoint(f"{root}/step-3").ok
    assert [r.step for r in ckpt.Ledger(Path(ledger)).rows() if r.event == "tombstone"] == [1, 2]


def test_check_free_lists_the_directory_once(s3_env: S3Server, tmp_path: Path) -> None:
    """check_free for 1,000 planned steps costs one LIST request (not one request per step), counted by a proxy
    in front of the server; a taken step is still found and named."""
    root = _prefix()
    with FaultProxy(s3_env.endpoint) as proxy:
        m = ckpt.CheckpointManager(
            root, ledger_path=str(tmp_path / "lineage.sqlite"), storage_options={"endpoint_url": proxy.endpoint}
        )
        model, opt = sc._model()
        sc._save(m, model, opt, 700)
        proxy.reset()
        m.check_free(range(1, 700))
        m.check_free(range(701, 1001))
        assert proxy.counts() == {"list": 2}, proxy.counts()
        proxy.reset()
        with pytest.raises(CheckpointExistsError, match=r"step-700 already exists.*resume from it"):
            m.check_free(range(1, 1001))
        assert proxy.counts()["list"] == 1, proxy.counts()
