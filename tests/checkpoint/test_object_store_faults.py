"""Faults between the client and the store at each kind of request the bucket protocol makes, delivered by a real
proxy (``s3_proxy.py``) in front of the session's SeaweedFS server: a response lost after the store acted on the
request, ``500 InternalError`` and ``503 SlowDown``.

A save into the bucket with retention (resume step 2, save step 3, delete step 1) and a quarantine (resume finds
step 2 damaged, moves it aside, saves step 2 again) run through the proxy with each fault on the first request of
every role at once; then a save with a fault that does not pass (every retry refused) on one role at a time. After
each, the next run -- straight to the server -- checks what the crash-point test checks
(:func:`.object_crashes.recover`): it resumes, loses no committed step, reports nothing tampered, saves the
interrupted step again, leaves nothing behind, and the chain verifies.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from shardline.errors import CheckpointError
from tests.checkpoint import object_crashes
from tests.checkpoint.conftest import S3_BUCKET
from tests.checkpoint.s3_proxy import FAULTS, FaultKind, FaultProxy, Request
from tests.checkpoint.seaweed import S3Server

pytestmark = pytest.mark.timeout(180)

_CLAIM = ".shardline-claim"
_RECORDS = ("SHA256SUMS", "manifest.sha256", "provenance.intoto.json")
# Every kind of request the two scenarios make, by what it does in the protocol.
ROLES: dict[str, Callable[[Request], bool]] = {
    "list a prefix": lambda r: r.kind == "list",
    "head an object": lambda r: r.kind == "head",
    "read a manifest": lambda r: r.kind == "get" and r.key.endswith("/manifest.json"),
    "read a shard": lambda r: r.kind == "get" and r.key.endswith(".distcp"),
    "read the claim": lambda r: r.kind == "get" and r.key.endswith(_CLAIM),
    "claim (If-None-Match)": lambda r: r.kind == "put-if-none-match" and r.key.endswith(_CLAIM),
    "upload a shard": lambda r: r.kind == "put" and r.key.endswith(".distcp"),
    "upload .metadata.tmp": lambda r: r.kind == "put" and r.key.endswith("/.metadata.tmp"),
    "copy (.metadata, a quarantine)": lambda r: r.kind == "copy",
    "upload a record": lambda r: r.kind == "put" and r.key.endswith(_RECORDS),
    "manifest (If-None-Match)": lambda r: r.kind == "put-if-none-match" and r.key.endswith("/manifest.json"),
    "delete the claim": lambda r: r.kind == "delete" and r.key.endswith(_CLAIM),
    "delete a manifest": lambda r: r.kind == "delete" and r.key.endswith("/manifest.json"),
    "delete .metadata.tmp": lambda r: r.kind == "delete" and r.key.endswith("/.metadata.tmp"),
    "delete a prefix (batch)": lambda r: r.kind == "delete-batch",
}
# No retries by the client (s3fs itself does not retry a 500): a fault that never passes fails at once.
_IMPATIENT = {"config_kwargs": {"retries": {"max_attempts": 1}}}


def _prefix() -> str:
    return f"s3://{S3_BUCKET}/{uuid.uuid4().hex[:12]}"


@pytest.fixture
def proxy(s3_env: S3Server) -> Iterator[FaultProxy]:
    with FaultProxy(s3_env.endpoint) as p:
        yield p


# Each 500 or 503 costs the client a backoff of up to a second: the quarantine (whose requests are the save's, plus
# copies and deletes) gets the lost responses, the fault a retry can turn into a wrong answer.
@pytest.mark.parametrize(("scenario", "fault"), [("save", f) for f in FAULTS] + [("quarantine", "lose")])
def test_a_fault_on_each_kind_of_request_is_retried_through(
    s3_env: S3Server, proxy: FaultProxy, tmp_path: Path, scenario: str, fault: FaultKind
) -> None:
    """The first request of every role gets ``fault`` (all in one run); the client's retries carry the action
    through, and the next run finds a healthy directory."""
    root, ledger = _prefix(), str(tmp_path / "run" / "lineage.sqlite")
    object_crashes.prepare(scenario, root, ledger, s3_env.env)
    injected = {role: proxy.inject(fault, match) for role, match in ROLES.items()}
    object_crashes.act(scenario, root, ledger, s3_env.env, endpoint_url=proxy.endpoint)
    missed = sorted(role for role, f in injected.items() if f.hits == 0)
    assert not missed, f"{scenario}: no request of these roles was made: {missed}"
    assert [o for _, o in proxy.seen].count("lost" if fault == "lose" else fault) == len(ROLES)
    assert object_crashes.recover(scenario, root, ledger, s3_env.env) == object_crashes.SCENARIOS[scenario].saving


@pytest.mark.parametrize(
    ("role", "fails"),
    [
        ("claim (If-None-Match)", True),
        ("upload a shard", True),
        ("manifest (If-None-Match)", True),
        ("delete .metadata.tmp", True),  # DCP's rename of .metadata cannot finish
        ("delete the claim", False),  # after the commit: the next open removes the claim
        ("delete a manifest", False),  # retention's first delete: logged, the next save deletes it
        ("delete a prefix (batch)", False),  # retention's second: the same
    ],
)
def test_a_fault_that_does_not_pass_fails_the_save_cleanly(
    s3_env: S3Server, proxy: FaultProxy, tmp_path: Path, role: str, fails: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Every request of one role gets 500 InternalError, retries included: a save whose claim, upload, manifest or
    .metadata rename is refused fails with one line naming the checkpoint, the endpoint and the store's error, and
    saying nothing was committed; a refused delete after the commit (the claim's, or retention's) is logged.
    Either way the next run resumes, saves the step, and leaves nothing behind."""
    root, ledger = _prefix(), str(tmp_path / "run" / "lineage.sqlite")
    object_crashes.prepare("save", root, ledger, s3_env.env)
    proxy.inject("500", ROLES[role], times=1000)
    with caplog.at_level(logging.WARNING, logger="shardline"):
        try:
            object_crashes.act("save", root, ledger, s3_env.env, endpoint_url=proxy.endpoint, **_IMPATIENT)
            failure = None
        except CheckpointError as e:
            failure = str(e)
    assert any(o == "500" for _, o in proxy.seen), f"{role}: no request was refused"
    if fails:
        assert failure is not None, f"{role}: the save committed although every such request was refused"
        assert "\n" not in failure, failure
        assert f"checkpoint {root}/step-3 (endpoint {proxy.endpoint}) failed" in failure, failure
        assert "We encountered an internal error" in failure, failure
        assert "nothing was committed" in failure or "no checkpoint was written" in failure, failure
        assert failure.endswith(f"the last good checkpoint is {root}/step-2"), failure
    else:
        assert failure is None, failure
    if role in ("delete a manifest", "delete a prefix (batch)"):
        assert f"retention: could not delete {root}/step-1" in caplog.text, caplog.text
    object_crashes.recover("save", root, ledger, s3_env.env)
