"""The public API is a promise: ``shardline.checkpoint`` exports what a user calls, test hooks are
``shardline.testing``'s, the engine's checkpoint internals are private, and every name that moved still imports
from its old place for one release, with a DeprecationWarning naming the new home."""

from __future__ import annotations

import ast
import importlib
import warnings
from pathlib import Path

import pytest

import shardline
import shardline.checkpoint
import shardline.engine
import shardline.testing

SRC = Path(shardline.__file__).parent

# Widening this set is a decision: a name here is supported as public API.
CHECKPOINT_API = {
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
}

# Old name -> the module users import it from now.
CHECKPOINT_MOVED = {
    "FAULT_EXIT_CODE": "shardline.testing",
    "SaveObserver": "shardline.testing",
    "SavePhase": "shardline.testing",
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
}

ENGINE_INTERNALS = [
    "HOST_OOM",
    "ManagedParam",
    "buffer_original_dtypes",
    "gather_full_tensors",
    "host_copy",
    "key_problems",
    "managed_parameters",
    "plain_state_dict",
    "registered_state_dict",
    "release_all",
]

# The hooks tests pass to a save, and where they are defined (the checkpoint package keeps them there).
TEST_HOOKS = {
    "FAULT_EXIT_CODE": "shardline.checkpoint.faults.fault",
    "FailWrites": "shardline.checkpoint.faults.fault",
    "KillAtPhase": "shardline.checkpoint.faults.fault",
    "SaveObserver": "shardline.checkpoint.faults.observer",
    "SavePhase": "shardline.checkpoint.faults.observer",
    "CRASH_EXIT_CODE": "shardline.checkpoint.faults.crashpoints",
    "CRASH_POINTS": "shardline.checkpoint.faults.crashpoints",
}


def test_checkpoint_exports_exactly_the_user_api() -> None:
    assert set(shardline.checkpoint.__all__) == CHECKPOINT_API
    assert len(shardline.checkpoint.__all__) == len(CHECKPOINT_API)  # no name twice


@pytest.mark.parametrize("package", ["shardline", "shardline.checkpoint", "shardline.engine", "shardline.testing"])
def test_every_exported_name_resolves_without_a_warning(package: str) -> None:
    module = importlib.import_module(package)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        missing = [name for name in module.__all__ if getattr(module, name, None) is None]
    assert missing == []


@pytest.mark.parametrize(("name", "home"), sorted(CHECKPOINT_MOVED.items()))
def test_a_moved_checkpoint_name_warns_and_is_the_same_object(name: str, home: str) -> None:
    assert name not in shardline.checkpoint.__all__
    with pytest.warns(DeprecationWarning, match=rf"{home}\.{name}.*the next minor release"):
        old = getattr(shardline.checkpoint, name)
    assert old is getattr(importlib.import_module(home), name)


def test_old_from_imports_still_work_with_a_warning() -> None:
    with pytest.warns(DeprecationWarning, match="shardline.testing"):
        from shardline.checkpoint import SaveObserver
    assert SaveObserver is shardline.testing.SaveObserver


def test_an_unknown_name_is_still_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        _ = shardline.checkpoint.nothing_here  # type: ignore[attr-defined]
    with pytest.raises(ImportError):
        from shardline.engine import nothing_here  # type: ignore[attr-defined]  # noqa: F401


@pytest.mark.parametrize(("name", "module"), sorted(TEST_HOOKS.items()))
def test_test_hooks_are_shardline_testing_names(name: str, module: str) -> None:
    assert name in shardline.testing.__all__
    assert getattr(shardline.testing, name) is getattr(importlib.import_module(module), name)
    assert name not in shardline.checkpoint.__all__
    assert name not in shardline.__all__


def test_crash_point_machinery_is_in_shardline_testing() -> None:
    crashpoints = importlib.import_module("shardline.checkpoint.faults.crashpoints")
    assert shardline.testing.arm_crash_point is crashpoints.arm
    assert shardline.testing.disarm_crash_points is crashpoints.disarm
    assert shardline.testing.trace_crash_points is crashpoints.trace
    assert shardline.testing.traced_crash_points is crashpoints.traced


@pytest.mark.parametrize("name", ENGINE_INTERNALS)
def test_engine_internals_are_private_and_warn_from_the_old_place(name: str) -> None:
    support = importlib.import_module("shardline.engine._checkpoint_support")
    assert name not in shardline.engine.__all__
    assert name in support.__all__
    with pytest.warns(DeprecationWarning, match=rf"shardline\.engine\.{name} is internal.*the next minor release"):
        old = getattr(shardline.engine, name)
    assert old is getattr(support, name)


def test_no_module_outside_the_engine_imports_its_internals_from_the_public_face() -> None:
    wrong = []
    for path in sorted(SRC.rglob("*.py")):
        if path.is_relative_to(SRC / "engine"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "shardline.engine":
                wrong += [f"{path.relative_to(SRC)}: {a.name}" for a in node.names if a.name in ENGINE_INTERNALS]
    assert wrong == []


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("sign_checkpoint", "sign_checkpoint"),
        ("check_signature", "check_signature"),
        ("store_signature_path", "default_signature_path"),
    ],
)
def test_the_object_store_signing_names_warn_and_are_the_signing_modules(old: str, new: str) -> None:
    from shardline.checkpoint.provenance import signing, store_signing

    with pytest.warns(DeprecationWarning, match=rf"store_signing\.{old} moved to .*signing\.{new}"):
        value = getattr(store_signing, old)
    assert value is getattr(signing, new)
    with pytest.raises(AttributeError):
        store_signing.sign  # noqa: B018 -- only the earlier names live here
