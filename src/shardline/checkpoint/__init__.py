"""Checkpoints with shard lineage: DCP files hashed while written, a manifest, atomic commit, resharding loads.

See docs/checkpoints.md (usage), docs/checkpoint-protocol.md (format, commit protocol) and
docs/verification.md (checking a checkpoint with standard tools).

The names below are the public API. Test hooks (save observers, injected faults, crash points) are
:mod:`shardline.testing`'s; the building blocks live in the sub-packages. Names this package used to export
still import from it until the next minor release, with a DeprecationWarning naming their new home.
"""

from shardline._deprecation import moved_names
from shardline.checkpoint.integrity.dcp_reader import Reader
from shardline.checkpoint.integrity.verify import VerifyLevel, VerifyReport, verify_checkpoint
from shardline.checkpoint.lifecycle.adopt import AdoptedCheckpoint, adopt
from shardline.checkpoint.lifecycle.capture import SaveRequest
from shardline.checkpoint.lifecycle.consolidate import ConsolidationResult, consolidate
from shardline.checkpoint.lifecycle.dcp_writer import Writer
from shardline.checkpoint.lifecycle.load import load, load_config
from shardline.checkpoint.lifecycle.manager import CheckpointManager, CommittedCheckpoint
from shardline.checkpoint.lifecycle.save import CheckpointInfo, save
from shardline.checkpoint.provenance.ledger import Ledger, LedgerRow, LineageReport
from shardline.checkpoint.provenance.lineage import audit
from shardline.checkpoint.state.model_state import load_model_state_dict, model_state_dict
from shardline.checkpoint.state.optim_state import load_optimizer_state_dict, optimizer_state_dict
from shardline.checkpoint.state.rng import capture_rng_state, restore_rng_state

__all__ = [
    "AdoptedCheckpoint",
    "CheckpointInfo",
    "CheckpointManager",
    "CommittedCheckpoint",
    "ConsolidationResult",
    "Ledger",
    "LedgerRow",
    "LineageReport",
    "Reader",
    "SaveRequest",
    "VerifyLevel",
    "VerifyReport",
    "Writer",
    "adopt",
    "audit",
    "capture_rng_state",
    "consolidate",
    "load",
    "load_config",
    "load_model_state_dict",
    "load_optimizer_state_dict",
    "model_state_dict",
    "optimizer_state_dict",
    "restore_rng_state",
    "save",
    "verify_checkpoint",
]

_TESTING = "shardline.testing"
__getattr__ = moved_names(
    __name__,
    {
        "FAULT_EXIT_CODE": _TESTING,
        "SaveObserver": _TESTING,
        "SavePhase": _TESTING,
        "canonical_json": "shardline.checkpoint.format.canonical",
        "config_hash": "shardline.checkpoint.format.canonical",
        "manifest_hash": "shardline.checkpoint.format.canonical",
        "read_manifest": "shardline.checkpoint.integrity.manifest",
        "OpenedCheckpoint": "shardline.checkpoint.integrity.opening",
        "open_checkpoint": "shardline.checkpoint.integrity.opening",
        "FileProblem": "shardline.checkpoint.integrity.verify",
        "check_checkpoint": "shardline.checkpoint.lifecycle.load",
        "load_trainer_state": "shardline.checkpoint.lifecycle.load",
        "summarize": "shardline.checkpoint.lifecycle.summary",
        "StateDictKind": "shardline.checkpoint.state.model_state",
    },
    # shardline.testing sits above this package: read its names where they are defined.
    defined_in={
        "FAULT_EXIT_CODE": "shardline.checkpoint.faults.fault",
        "SaveObserver": "shardline.checkpoint.faults.observer",
        "SavePhase": "shardline.checkpoint.faults.observer",
    },
)
