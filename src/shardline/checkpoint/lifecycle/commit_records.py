"""The records rank 0 writes to commit a checkpoint: manifest, provenance statement, ``SHA256SUMS``.

Step 4 of the save protocol (:mod:`.save`); the DCP-native writer commits through the same code.
"""

from __future__ import annotations

import datetime
from typing import NamedTuple

from shardline.checkpoint.format.canonical import canonical_json, sha256_hex
from shardline.checkpoint.integrity.hashing import FileDigest
from shardline.checkpoint.integrity.manifest import build_manifest, render_sums
from shardline.checkpoint.lifecycle.capture import CapturedCheckpoint
from shardline.checkpoint.provenance.statement import STATEMENT_FILE, build_statement

__all__ = ["CommitRecords", "build_records"]


class CommitRecords(NamedTuple):
    """What rank 0 writes to commit a checkpoint (:func:`build_records`), every piece encoded once."""

    statement: bytes
    statement_sha256: str
    files: list[FileDigest]
    """What every rank learns the checkpoint holds (counted as before the statement named the manifest): the data
    files, ``.metadata`` and the statement; not ``manifest.json`` and its two hash files."""
    manifest: bytes
    manifest_sha256: str
    sums: bytes


def build_records(captured: CapturedCheckpoint, digests: list[FileDigest]) -> CommitRecords:
    """The manifest of the files ``digests``, then the provenance statement naming it, then ``SHA256SUMS``.

    Note: the file list (131k entries at 16,384 ranks x 8 files) is built, checked and encoded once, in the
    manifest; the statement names the manifest by its hash (``statement.py``), and ``SHA256SUMS`` is rendered
    from the manifest's own entries plus the statement's.
    """
    created = datetime.datetime.now(datetime.timezone.utc)
    manifest = build_manifest(
        step=captured.step,
        tag=captured.tag,
        kind=captured.kind,
        world_size=captured.world_size,
        units=captured.units,
        model_info=captured.model_info,
        contents=captured.contents,
        config_sha256=captured.config_sha256,
        data_fingerprint=captured.data_fingerprint,
        parent_manifest_sha256=captured.parent_manifest_hash,
        files=digests,
        created=created,
        sharding=captured.sharding or None,
        run_tags=captured.run_tags,
    )
    data = canonical_json(manifest)
    digest = sha256_hex(data)
    statement = canonical_json(
        build_statement(
            manifest_sha256=digest,
            step=captured.step,
            tag=captured.tag,
            kind=captured.kind,
            created_at=manifest["created_at"],
            config=captured.config,
            config_sha256=captured.config_sha256,
            data_fingerprint=captured.data_fingerprint,
            parent_manifest_sha256=captured.parent_manifest_hash,
            world_size=captured.world_size,
            units=captured.units,
            run_tags=captured.run_tags,
        )
    )
    statement_digest = sha256_hex(statement)
    own = FileDigest(path=STATEMENT_FILE, rank=0, bytes=len(statement), sha256=statement_digest)
    sums = render_sums(digest, [*manifest["files"], own.to_json()])
    return CommitRecords(statement, statement_digest, [*digests, own], data, digest, sums)
