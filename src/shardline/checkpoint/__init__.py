"""Checkpoints with shard lineage: DCP files hashed while written, a manifest, atomic commit, resharding loads.

See docs/checkpoints.md (usage), docs/checkpoint-protocol.md (format, commit protocol) and
docs/verification.md (checking a checkpoint with standard tools).
"""

from shardline.checkpoint.faults.fault import FAULT_EXIT_CODE
from shardline.checkpoint.faults.observer import SaveObserver, SavePhase
from shardline.checkpoint.format.canonical import canonical_json, config_hash, manifest_hash
from shardline.checkpoint.integrity.manifest import read_manifest
from shardline.checkpoint.integrity.opening import OpenedCheckpoint, open_checkpoint
from shardline.checkpoint.integrity.verify import FileProblem, VerifyLevel, VerifyReport, verify_checkpoint
from shardline.checkpoint.lifecycle.capture import SaveRequest
from shardline.checkpoint.lifecycle.consolidate import ConsolidationResult, consolidate
from shardline.checkpoint.lifecycle.load import check_checkpoint, load, load_config, load_trainer_state
from shardline.checkpoint.lifecycle.manager import CheckpointManager, CommittedCheckpoint
from shardline.checkpoint.lifecycle.save import CheckpointInfo, save
from shardline.checkpoint.lifecycle.summary import summarize
from shardline.checkpoint.provenance.ledger import Ledger, LedgerRow, LineageReport
from shardline.checkpoint.provenance.lineage import audit
from shardline.checkpoint.state.model_state import StateDictKind, load_model_state_dict, model_state_dict
from shardline.checkpoint.state.optim_state import load_optimizer_state_dict, optimizer_state_dict
from shardline.checkpoint.state.rng import capture_rng_state, restore_rng_state

__all__ = [
    "FAULT_EXIT_CODE",
    "CheckpointInfo",
    "CheckpointManager",
    "CommittedCheckpoint",
    "ConsolidationResult",
    "FileProblem",
    "Ledger",
    "LedgerRow",
    "LineageReport",
    "OpenedCheckpoint",
    "SaveObserver",
    "SavePhase",
    "SaveRequest",
    "StateDictKind",
    "VerifyLevel",
    "VerifyReport",
    "audit",
    "canonical_json",
    "capture_rng_state",
    "check_checkpoint",
    "config_hash",
    "consolidate",
    "load",
    "load_config",
    "load_model_state_dict",
    "load_optimizer_state_dict",
    "load_trainer_state",
    "manifest_hash",
    "model_state_dict",
    "open_checkpoint",
    "optimizer_state_dict",
    "read_manifest",
    "restore_rng_state",
    "save",
    "summarize",
    "verify_checkpoint",
]
