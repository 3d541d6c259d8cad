"""``load``: verify a checkpoint, then load it into a model of any world size and strategy.

Note: nothing unverified is used (see ``opening.py`` for the order of checks). Rank 0 anchors
the manifest and checks the listing; every rank hashes ``.metadata`` before unpickling it and
checks the model against it (DCP's plan step carries the verdicts: a rank that cannot
prepare fails every rank there, before anything is read); DCP then reads the data through
:class:`~.reading.VerifyingReader`, each rank hashing a disjoint share of the files in the pass
that reads them, and DCP's read all-gather is the agreement. Nothing the load produced is used
before it: buffers, 0-d parameters, the optimizer state (``load_state_dict``) and the trainer
state are installed, and ``load`` returns, only once every rank knows every file verified.
Cost: one SHA-256 pass over the checkpoint, spread over the ranks and overlapped with reading.

Like plain DCP, the data is read in place into the model's shards (and into optimizer state
tensors the optimizer already holds), so a load that raises leaves those values undefined:
load a checkpoint that verifies (``CheckpointManager.load("auto")`` does) or rebuild them.
Staging copies would keep them intact at the cost of a copy of every shard per load.

Note: how resharding works. Every parameter target is the live shard exposed as a DTensor
piece (``ManagedParam.to_dtensor``, no copy); DCP's planner intersects the pieces each rank
asks for with the chunks each file holds and reads exactly the overlapping rows. So W -> W' and
FULL_SHARD <-> NO_SHARD (a ``Replicate`` piece asks for all rows) need no gather, and a
checkpoint saved with kind ``full`` (one chunk per tensor) loads the same way.

Note: optimizer state is initialized from the checkpoint's own metadata, not by a dummy
optimizer step: for each ``optim.state.<fqn>.<name>`` item we allocate an empty tensor shaped
like this rank's shard (elementwise state, as a DTensor piece placed like the parameter) or a
0-d tensor (scalar state), DCP fills them, and ``Optimizer.load_state_dict`` installs them
(casting as torch does). No hyperparameter is touched and nothing depends on the optimizer's
update rule.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan

from shardline.checkpoint.coordination import coord
from shardline.checkpoint.format.dcp_io import (
    CONFIG_KEY,
    MODEL_KEY,
    OPTIM_KEY,
    PER_RANK_KEY,
    TRAINER_KEY,
    build_tree,
    decode_state,
    key_paths,
    subtree,
)
from shardline.checkpoint.format.load_planner import ShardlineLoadPlanner
from shardline.checkpoint.integrity.opening import (
    CheckedManifest,
    check_manifest,
    integrity_error,
    open_checkpoint,
    read_checked_metadata,
)
from shardline.checkpoint.integrity.reading import VerifyingReader
from shardline.checkpoint.integrity.verify import VerifyLevel, check_files, level_argument
from shardline.checkpoint.state.engines import detect_engine, install_torch_state, torch_state
from shardline.checkpoint.state.model_state import param_index
from shardline.checkpoint.state.optim_state import load_optimizer_state_dict, optimizer_params
from shardline.checkpoint.storage.protocol import Location
from shardline.checkpoint.storage.stores import locate
from shardline.engine._checkpoint_support import key_problems, registered_state_dict, release_all
from shardline.errors import (
    CheckpointError,
    CheckpointMismatchError,
    CheckpointWarning,
    ShardlineError,
)

__all__ = ["check_checkpoint", "load", "load_config", "load_trainer_state", "load_verified", "opt_in_note"]

_SHOW = 10


def opt_in_note(checked: CheckedManifest) -> str | None:
    """The one line that says a checkpoint was used without hashing every byte (None at level ``full``)."""
    if not checked.level.opt_in:
        return None
    if checked.manifest is None:
        return (
            f"{checked.path} is a plain torch.distributed.checkpoint directory without a shardline manifest: it has "
            "no lineage and its files cannot be verified; loading it anyway (verify='none')"
        )
    what = "file sizes only" if checked.level is VerifyLevel.SIZES else "no file checks"
    return (
        f"checkpoint {checked.path} loaded with verify={checked.level.value!r} ({what}): its data files were not "
        "hashed, so damaged bytes would go unnoticed; the default 'full' checks every byte"
    )


def _checked(
    path: Location, level: VerifyLevel, expected: str | None, group: dist.ProcessGroup | None, *, whole: bool
) -> CheckedManifest:
    """Rank 0 checks the manifest (steps 1-2 of ``opening.py``); every rank gets the result, or its error.

    ``whole=False`` sends the other ranks only what a load uses of the manifest before its plan step (see
    ``CheckedManifest.to_json``): their share of the data files' entries reaches them in their DCP load plans.
    """
    mine: list[CheckedManifest] = []

    def decide() -> dict[str, Any]:
        mine.append(check_manifest(path, level=level, expected_manifest_hash=expected))
        return mine[0].to_json(whole=whole)

    data = coord.rank0_decides(decide, group)
    checked = mine[0] if mine else CheckedManifest.from_json(data)
    checked = dataclasses.replace(checked, path=path)  # this rank's storage options
    note = opt_in_note(checked)
    if note is not None and coord.group_rank(group) == 0:
        warnings.warn(note, CheckpointWarning, stacklevel=3)
    return checked


def check_checkpoint(
    path: str | os.PathLike[str],
    *,
    level: VerifyLevel | str = VerifyLevel.FULL,
    expected_manifest_hash: str | None = None,
    process_group: dist.ProcessGroup | None = None,
    storage_options: Mapping[str, Any] | None = None,
    verify: VerifyLevel | str | None = None,
) -> dict[str, Any] | None:
    """Verify a checkpoint without loading it (a collective); return its manifest, or None for plain DCP.

    ``level`` ``full`` (default): the anchored manifest, the listing, and every file's SHA-256, the files
    spread over the ranks. ``sizes``: no re-hashing of data files (a :class:`CheckpointWarning`
    says so). ``none``: only that it is a checkpoint (the only level a plain DCP directory passes).
    ``verify=`` is the deprecated name of ``level=``.

    Raises:
        CheckpointNotFoundError, IntegrityError: on every rank.
        ConfigurationError: an unknown level (the message lists the valid ones).
    """
    level = level_argument(level, verify, caller="check_checkpoint")
    checked = _checked(
        locate(path, storage_options=storage_options), level, expected_manifest_hash, process_group, whole=True
    )
    if level is VerifyLevel.FULL:
        rank, world = coord.group_rank(process_group), coord.group_size(process_group)

        def hash_share() -> None:
            problems, _ = check_files(checked.path, checked.entries()[rank::world], VerifyLevel.FULL)
            if problems:
                raise integrity_error(checked.path, problems, what="it must not be loaded")

        coord.all_succeed(hash_share, process_group, what=f"verify its share of {path}")
    return checked.manifest


def _mismatch(path: Location, problems: list[str]) -> CheckpointMismatchError:
    shown = "; ".join(problems[:_SHOW]) + (f"; ... ({len(problems) - _SHOW} more)" if len(problems) > _SHOW else "")
    return CheckpointMismatchError(
        f"checkpoint {path} does not fit this model/optimizer -- {shown}. Load it into the model architecture it "
        "was saved from (world size and sharding strategy may differ)."
    )


def _model_targets(
    model: nn.Module, metadata: Metadata, prefix: tuple[Any, ...], strict: bool, problems: list[str]
) -> tuple[dict[str, Any], list[Callable[[], None]]]:
    stored = {path[0]: md for path, md in subtree(metadata, prefix) if len(path) == 1}
    if not prefix:  # a flat (plain DCP) model state dict: tensors at the top level only
        stored = {k: md for k, md in stored.items() if isinstance(md, TensorStorageMetadata)}
    index = param_index(model)
    local = registered_state_dict(model)
    if strict:
        problems += key_problems(local, stored, missing="the checkpoint lacks", unexpected="the model lacks")
    targets: dict[str, Any] = {}
    after: list[Callable[[], None]] = []
    done: set[int] = set()
    for key, value in local.items():
        md = stored.get(key)
        if md is None:
            continue
        if not isinstance(md, TensorStorageMetadata):
            problems.append(f"{key}: the checkpoint holds a non-tensor object there")
            continue
        size = tuple(md.size)
        found = index.get(id(value))
        if found is None:
            if size != tuple(value.shape):
                problems.append(f"{key}: checkpoint shape {size} vs model {tuple(value.shape)}")
                continue
            temp = torch.empty(size, dtype=md.properties.dtype)
            targets[key] = temp
            after.append(
                functools.partial(lambda v, t: v.data.copy_(t.to(device=v.device, dtype=v.dtype)), value, temp)
            )
            continue
        if id(found.shard) in done:
            continue
        if size == found.global_shape:
            targets[key] = found.to_dtensor()
        elif size == () and found.shape == ():
            temp = torch.empty((), dtype=md.properties.dtype)
            targets[key] = temp
            after.append(functools.partial(found.load_full, temp))
        else:
            problems.append(f"{key}: checkpoint shape {size} vs model {found.shape}")
            continue
        done.add(id(found.shard))
    return targets, after


def _optim_targets(
    model: nn.Module, optimizer: torch.optim.Optimizer, metadata: Metadata, problems: list[str]
) -> dict[str, Any]:
    entries = subtree(metadata, (OPTIM_KEY,))
    if not entries:
        problems.append("an optimizer was passed but the checkpoint holds no optimizer state ('optim.*' keys)")
        return {}
    params = optimizer_params(model, optimizer)
    by_fqn = {fqn: managed for _, fqn, managed in params}
    # Note: state tensors the optimizer already holds (same shape, dtype and device) are read into
    # in place, as plain DCP would; a fresh optimizer gets new tensors.
    current = {fqn: optimizer.state.get(param, {}) for param, fqn, _ in params}
    placed: list[tuple[tuple[Any, ...], torch.Tensor | None]] = []
    for path, md in entries:
        if not isinstance(md, TensorStorageMetadata):
            placed.append((path, None))
            continue
        if len(path) != 3 or path[0] != "state":
            problems.append(f"optimizer item {'.'.join(map(str, path))} is not in the FQN-keyed layout")
            continue
        fqn, name = path[1], path[2]
        if fqn not in by_fqn:
            problems.append(f"optimizer state for '{fqn}', which this optimizer does not hold")
            continue
        size, dtype, managed = tuple(md.size), md.properties.dtype, by_fqn[fqn]
        if managed is None or size == ():
            placed.append((path, torch.empty(size, dtype=dtype)))
        elif size == managed.global_shape:
            held = current[fqn].get(name)
            device = managed.shard.device
            fits = (
                isinstance(held, torch.Tensor)
                and held.dtype == dtype
                and held.device == device
                and held.is_contiguous()
            )
            local = held if fits and tuple(held.shape) == managed.local_shape else None
            if local is None:
                local = torch.empty(managed.local_shape, dtype=dtype, device=device)
            placed.append((path, managed.to_dtensor(local)))
        else:
            problems.append(
                f"optimizer state '{name}' of '{fqn}': checkpoint shape {size} vs parameter {managed.global_shape}"
            )
    tree: dict[str, Any] = build_tree(placed)  # keyed "state" / "param_groups" at the top
    # A stateless optimizer (plain SGD) saves an empty "state", which DCP stores as no item at all.
    tree.setdefault("state", {})
    return tree


def _torch_targets(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    metadata: Metadata,
    prefix: tuple[Any, ...],
    strict: bool,
    problems: list[str],
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """DCP targets for a model sharded by a torch engine: the pieces torch's state-dict API gives, checked first.

    The model's pieces (DTensor / ShardedTensor / tensors) and the optimizer's state tensors
    (initialized by torch when the optimizer is fresh) are read into in place; ``load``'s install
    step hands them back to torch's ``set_state_dict``, which restores the engine's own layout.
    """
    model_sd, optim_sd = torch_state(model, optimizer)
    stored = {path[0]: md for path, md in subtree(metadata, prefix) if len(path) == 1}
    if not prefix:  # a flat (plain DCP) model state dict: tensors at the top level only
        stored = {k: md for k, md in stored.items() if isinstance(md, TensorStorageMetadata)}
    if strict:
        problems += key_problems(model_sd, stored, missing="the checkpoint lacks", unexpected="the model lacks")
    model_targets: dict[str, Any] = {}
    for key, value in model_sd.items():
        md = stored.get(key)
        if md is None:
            continue
        if not isinstance(md, TensorStorageMetadata):
            problems.append(f"{key}: the checkpoint holds a non-tensor object there")
        elif tuple(md.size) != tuple(value.shape):
            problems.append(f"{key}: checkpoint shape {tuple(md.size)} vs model {tuple(value.shape)}")
        else:
            model_targets[key] = value
    if optim_sd is None:
        return model_targets, None
    entries = subtree(metadata, (OPTIM_KEY,))
    if not entries:
        problems.append("an optimizer was passed but the checkpoint holds no optimizer state ('optim.*' keys)")
    held: Mapping[str, Mapping[str, Any]] = optim_sd.get("state", {})
    placed: list[tuple[tuple[Any, ...], Any]] = []
    for path, md in entries:
        if not isinstance(md, TensorStorageMetadata):
            placed.append((path, None))
            continue
        if len(path) != 3 or path[0] != "state":
            problems.append(f"optimizer item {'.'.join(map(str, path))} is not in the FQN-keyed layout")
            continue
        fqn, name = path[1], path[2]
        value = held.get(fqn, {}).get(name)
        if not isinstance(value, torch.Tensor):
            problems.append(f"optimizer state '{name}' of '{fqn}', which this optimizer does not hold")
        elif tuple(value.shape) != tuple(md.size):
            problems.append(
                f"optimizer state '{name}' of '{fqn}': checkpoint shape {tuple(md.size)} vs {tuple(value.shape)}"
            )
        else:
            placed.append((path, value))
    tree: dict[str, Any] = build_tree(placed)
    return model_targets, tree


class _PrepareFailed(Exception):
    """A rank could not prepare its load: its error as plain data, on its way to every rank in DCP's plan step."""

    def __init__(self, payload: dict[str, str]) -> None:
        super().__init__(payload)
        self.payload = payload


class _Unprepared(ShardlineLoadPlanner):
    """The planner of a rank whose preparation failed: it plans nothing and raises that failure in DCP's plan step,
    which carries it to every rank before anything is read (see the note in ``load``)."""

    def __init__(self, payload: dict[str, str]) -> None:
        super().__init__()
        self._payload = payload

    def set_up_planner(
        self, state_dict: dict[str, Any], metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        raise _PrepareFailed(self._payload)  # the first step of DCP's plan after reading the metadata

    def create_local_plan(self) -> LoadPlan:
        raise _PrepareFailed(self._payload)  # never reached while DCP sets the planner up first


def _unprepared(error: CheckpointException, world: int, *, what: str) -> ShardlineError | None:
    """The error every rank raises when some rank could not prepare the load (worded as ``all_agree`` words it),
    or None when every rank prepared (DCP failed for another reason)."""
    failures: list[dict[str, str] | None] = [None] * world
    for rank, (exc, _trace) in error.failures.items():
        if isinstance(exc, _PrepareFailed) and 0 <= rank < world:
            failures[rank] = exc.payload
    payload = coord.agreed_failure(failures, what=what)
    return None if payload is None else coord.error_from_payload(payload)


def _dcp_error(path: Location, error: CheckpointException) -> ShardlineError:
    """One error for every rank from DCP's gathered per-rank failures: the lowest failing rank's."""

    # Note: a rank that could not deserialize an item of a file another rank hashes reports only that;
    # the hashing rank's "manifest records" verdict names the real cause, so it wins.
    def precedence(item: tuple[int, Any]) -> tuple[int, int]:
        rank, (exc, _trace) = item
        return (0 if "manifest records" in str(exc) else 1 if isinstance(exc, ShardlineError) else 2, rank)

    rank, (exc, _trace) = min(error.failures.items(), key=precedence)
    if isinstance(exc, ShardlineError):
        return coord.error_from_payload(coord.error_payload(exc))
    first = (str(exc).strip().splitlines() or [""])[0]
    return CheckpointError(f"reading checkpoint {path} failed on rank {rank}: {type(exc).__name__}: {first}")


def load(
    path: Location | str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    verify: VerifyLevel | str = VerifyLevel.FULL,
    strict: bool = True,
    expected_manifest_hash: str | None = None,
    process_group: dist.ProcessGroup | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Verify a checkpoint and load it into ``model`` (and ``optimizer``) at any world size and strategy.

    A collective. Nothing is installed into the model or optimizer unless every check passed on
    every rank (see the module note).

    Args:
        path: A committed checkpoint directory (a plain DCP directory only with ``verify="none"``), local or
            an object-store URL (``s3://bucket/prefix/step-100``; each rank streams and hashes its share).
        verify: ``"full"`` (default: every byte hashed against the manifest, spread over the ranks
            while reading), or the opt-ins ``"sizes"`` (file sizes only) and ``"none"``; an opt-in
            is reported with a :class:`CheckpointWarning`.
        strict: Model keys must match exactly (shapes always must).
        expected_manifest_hash: The manifest hash to trust (e.g. from the lineage ledger); without
            it the manifest is checked against ``manifest.sha256`` in the directory.
        storage_options: Options of the fsspec file system of a URL ``path`` (endpoint, credentials);
            default: the standard AWS environment.

    Returns:
        The trainer state saved with it (rank 0's), plus ``"per_rank"``: the entry this rank
        saved, present only if the checkpoint has one for this rank (it was saved with at
        least ``rank + 1`` ranks). Tensors come back on CPU.

    Raises:
        CheckpointNotFoundError: not a (committed) checkpoint.
        IntegrityError: a file missing, unexpected, or not matching the manifest (named); nothing loaded.
        CheckpointMismatchError: keys or shapes that do not fit; nothing is loaded then.
    """
    state, _ = load_verified(
        path,
        model=model,
        optimizer=optimizer,
        verify=verify,
        strict=strict,
        expected_manifest_hash=expected_manifest_hash,
        process_group=process_group,
        storage_options=storage_options,
    )
    return state


def load_verified(
    path: Location | str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    verify: VerifyLevel | str = VerifyLevel.FULL,
    strict: bool = True,
    expected_manifest_hash: str | None = None,
    process_group: dist.ProcessGroup | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> tuple[dict[str, Any], str | None]:
    """:func:`load`, also returning the hash of the manifest it was checked against (None for a plain DCP
    directory), on every rank: a resume chains its next save to it without reading the manifest again."""
    path = locate(path, storage_options=storage_options)
    level = VerifyLevel.parse(verify)
    checked = _checked(path, level, expected_manifest_hash, process_group, whole=False)
    rank = coord.group_rank(process_group)
    plan: dict[str, Any] = {}

    def prepare() -> None:
        metadata = read_checked_metadata(checked)
        tops = {p[0] for p in key_paths(metadata).values()}
        prefix: tuple[Any, ...] = (MODEL_KEY,) if MODEL_KEY in tops else ()
        problems: list[str] = []
        engine = detect_engine(model)
        if engine.uses_torch_state_dict:
            model_targets, optim_targets = _torch_targets(model, optimizer, metadata, prefix, strict, problems)
            after: list[Callable[[], None]] = []
        else:
            model_targets, after = _model_targets(model, metadata, prefix, strict, problems)
            optim_targets = _optim_targets(model, optimizer, metadata, problems) if optimizer is not None else None
        targets: dict[str, Any] = {MODEL_KEY: model_targets} if prefix else dict(model_targets)
        if optim_targets is not None:
            targets[OPTIM_KEY] = optim_targets
        if TRAINER_KEY in tops:
            targets[TRAINER_KEY] = None
        if str(rank) in {p[0] for p, _ in subtree(metadata, (PER_RANK_KEY,))}:
            targets[PER_RANK_KEY] = {str(rank): None}
        if problems:
            raise _mismatch(path, problems)
        plan.update(
            metadata=metadata,
            targets=targets,
            after=after,
            model_targets=model_targets,
            torch_api=engine.uses_torch_state_dict,
        )

    # Note: every rank checks the metadata against its model, and every rank must learn whether all
    # could before anything is read. DCP's plan step is that agreement already: it gathers every
    # rank's plan (or error) on the coordinator and scatters the plans, or the errors, to every rank,
    # all before ``read_data``. A rank whose preparation failed takes part with a planner that raises
    # its error there (:class:`_Unprepared`), and every rank raises it as ``all_agree`` would have --
    # one round trip fewer than an agreement of its own ahead of DCP's.
    what = f"prepare to load {path}"
    failure: dict[str, str] | None = None
    prepare_error: BaseException | None = None
    try:
        prepare()
    except Exception as e:
        failure, prepare_error = coord.error_payload(e), e
        if coord.group_size(process_group) == 1:
            coord.raise_payload(failure, e)  # as all_agree raises it: a shardline class, the same message
    if failure is None:
        targets = plan["targets"]
        # rank 0 (DCP's coordinator) holds every entry and assigns them; another rank gets its share in its plan
        to_hash = checked.data_entries() if level is VerifyLevel.FULL else []
        reader = VerifyingReader(path, plan["metadata"], to_hash=to_hash, verify=level is VerifyLevel.FULL)
        planner: ShardlineLoadPlanner = ShardlineLoadPlanner()
        release_all(model)  # free gathered parameters, so nothing stale shadows the shards being read
    else:
        targets = {}
        reader = VerifyingReader(path, Metadata(state_dict_metadata={}, storage_data={}), to_hash=())
        planner = _Unprepared(failure)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.load(
                targets,
                storage_reader=reader,
                planner=planner,
                process_group=process_group,
                no_dist=not dist.is_initialized(),
            )
    except CheckpointException as e:
        unprepared = _unprepared(e, coord.group_size(process_group), what=what)
        if unprepared is not None:
            raise unprepared from prepare_error
        raise _dcp_error(path, e) from None
    result: dict[str, dict[str, Any]] = {}

    def install() -> None:
        with torch.no_grad():
            for fn in plan["after"]:
                fn()
        if plan["torch_api"]:
            install_torch_state(model, optimizer, plan["model_targets"], targets.get(OPTIM_KEY), strict=strict)
        elif optimizer is not None:
            load_optimizer_state_dict(model, optimizer, targets[OPTIM_KEY], kind="sharded")
        state = decode_state(targets[TRAINER_KEY]) if targets.get(TRAINER_KEY) is not None else {}
        if not isinstance(state, dict):
            raise CheckpointMismatchError(
                f"checkpoint {path}: the trainer state is a {type(state).__name__}, not a dict"
            )
        if PER_RANK_KEY in targets:
            state["per_rank"] = decode_state(targets[PER_RANK_KEY][str(rank)])
        result["state"] = state

    # Note: the steps after DCP's read (buffers, optimizer state, trainer state) can fail on one rank
    # alone -- a per-rank entry that does not decode, say -- so every rank learns the outcome here
    # instead of its peers waiting in the next collective until the timeout.
    coord.all_succeed(install, process_group, what=f"install the state read from {path}")
    return result["state"], checked.manifest_hash


def _read_item(path: Location | str | os.PathLike[str], key: str, verify: VerifyLevel | str) -> Any:
    opened = open_checkpoint(path, level=verify)
    if key not in key_paths(opened.metadata):
        return None
    target: dict[str, Any] = {key: None}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.load(target, storage_reader=opened.reader(), planner=ShardlineLoadPlanner(), no_dist=True)
    return target[key]


def load_config(
    path: Location | str | os.PathLike[str], *, verify: VerifyLevel | str = VerifyLevel.FULL
) -> dict[str, Any] | None:
    """The training config stored in a checkpoint (None if it has none), read after verifying it (no process group).

    ``verify`` as for :func:`load` (``full`` hashes every file first).
    """
    text = _read_item(path, CONFIG_KEY, verify)
    if text is None:
        return None
    config: dict[str, Any] = json.loads(text)  # saved as the JSON of a dict
    return config


def load_trainer_state(
    path: Location | str | os.PathLike[str], *, verify: VerifyLevel | str = VerifyLevel.FULL
) -> dict[str, Any]:
    """The shared trainer state stored in a checkpoint (rank 0's), read offline after verifying it; ``{}`` if none."""
    data = _read_item(path, TRAINER_KEY, verify)
    if data is None:
        return {}
    state: dict[str, Any] = decode_state(data)  # a trainer state is saved as a dict
    return state
