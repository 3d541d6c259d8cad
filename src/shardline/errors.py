"""Exception types raised by shardline.

Every error a user can cause is one of these, so callers can catch ``ShardlineError`` and
tests can check the type. Each subclasses the matching builtin (``ValueError`` for bad
values, ``RuntimeError`` for bad state) so generic handlers keep working.
"""

from __future__ import annotations

from collections.abc import Iterator

__all__ = [
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointReadError",
    "CheckpointWarning",
    "ConfigurationError",
    "DiskFullError",
    "DistributedNotInitializedError",
    "IntegrityError",
    "LineageError",
    "PolicyMatchError",
    "PublishError",
    "RunLockedError",
    "ShardingError",
    "ShardlineError",
    "SignatureError",
    "StateDictError",
    "StorageAccessError",
    "error_chain",
]


class ShardlineError(Exception):
    """Base class of every error shardline raises on purpose."""


class ConfigurationError(ShardlineError, ValueError):
    """A value passed by the user is not valid (unknown strategy, mismatched mesh, bad dtype...)."""


class StorageAccessError(ConfigurationError):
    """An object-store checkpoint location cannot be used: no such bucket, refused credentials, no endpoint."""


class PolicyMatchError(ConfigurationError):
    """A wrap policy matched no module of the model."""


class ShardingError(ShardlineError, RuntimeError):
    """The module tree cannot be sharded as asked (sharded twice, shared across units, wrong device...)."""


class DistributedNotInitializedError(ShardlineError, RuntimeError):
    """An operation needs an initialized ``torch.distributed`` process group and there is none."""


class StateDictError(ShardlineError, ValueError):
    """A state dict does not fit the model: missing, unexpected or mis-shaped entries."""


class CheckpointError(ShardlineError, RuntimeError):
    """A checkpoint cannot be saved, found or loaded as asked (bad path, not a checkpoint, failed save...)."""


class CheckpointExistsError(CheckpointError):
    """The checkpoint directory to write already exists; nothing was written or overwritten."""


class CheckpointNotFoundError(CheckpointError):
    """A path is not a committed checkpoint (missing, partial, or not a checkpoint at all)."""


class CheckpointMismatchError(CheckpointError, StateDictError):
    """A checkpoint does not fit the model or optimizer it is loaded into (keys, shapes, layout)."""


class IntegrityError(CheckpointError):
    """A checkpoint's files do not match its manifest: missing, altered or unexpected files."""


class LineageError(CheckpointError):
    """The lineage ledger is unreadable or its hash chain does not verify."""


class DiskFullError(CheckpointError):
    """A checkpoint could not be written because the file system is full; nothing was committed."""


class CheckpointReadError(CheckpointError):
    """A checkpoint file could not be read (an I/O error, a permission, a decoder that refuses bytes that match
    the manifest): not damage, so nothing is moved aside; the message names the cause and how to fix it."""


class PublishError(CheckpointError):
    """A checkpoint committed, but recording it (``latest``, the ledger row) failed; ``info`` describes it.

    The checkpoint is complete and the next save chains to it; the next manager on the directory
    records it (marked ``recovered``) if its ledger row is missing.
    """

    def __init__(self, message: str, *, info: object = None) -> None:
        super().__init__(message)
        self.info = info


class SignatureError(CheckpointError):
    """A signature cannot be made or does not verify (bad key, missing signing extra, altered files)."""


class RunLockedError(ShardlineError, RuntimeError):
    """The run directory is in use by another run (its lock file names the holder)."""


class CheckpointWarning(UserWarning):
    """A checkpoint loads, but something a reviewer should know about it (e.g. it has no lineage manifest)."""


def error_chain(error: BaseException) -> Iterator[BaseException]:
    """``error``, its causes and contexts, and the per-rank errors a torch DCP ``CheckpointException`` carries.

    Each exception once, depth first. DCP's exception is recognised by its ``failures`` mapping
    (rank -> (exception, traceback)), so this module needs no torch import.
    """
    seen: set[int] = set()
    stack = [error]
    while stack:
        e = stack.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            stack.extend(
                v[0] for v in failures.values() if isinstance(v, tuple) and v and isinstance(v[0], BaseException)
            )
        stack.extend(c for c in (e.__cause__, e.__context__) if c is not None)
