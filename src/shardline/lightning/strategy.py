"""``ShardlineStrategy``: Lightning's ``Trainer`` training a model sharded by shardline.

It shards in ``setup`` (or takes a model already sharded in ``configure_model``), clips by the
true global gradient norm for ``gradient_clip_val`` and logs that norm, and saves and loads
Lightning checkpoints as shardline checkpoints -- a directory per checkpoint with a SHA-256
manifest, a lineage ledger beside it, verification on load, resharding to another world size,
optimizer state included. See docs/lightning.md.

Note: the root wrapper. Lightning calls ``training_step`` on the LightningModule itself, not its
``forward``, so a root unit installed on the LightningModule would never see its forward hooks
run. Like Lightning's FSDP strategy, the strategy wraps the LightningModule in a small root
module whose ``forward`` Lightning's forward redirection goes through; the root unit lives on
the wrapper and its hooks run around every step. State-dict keys inside shardline checkpoints
therefore start with ``module.``; exports (``shardline consolidate``) strip it.

Note: Lightning names with a leading underscore used here, each the way Lightning's own
strategies do it, with no public equivalent: ``_SubprocessScriptLauncher`` (starting the other
processes of ``python train.py``), ``LightningModule._device_mesh`` (what ``self.device_mesh``
returns in ``configure_model``), and the ``Strategy`` members ``_precision_plugin``,
``_launcher`` and ``_reset_optimizers_and_schedulers``. They are confined to this module.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
from collections.abc import Callable, Generator, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import shardline
import shardline.checkpoint as ckpt
from shardline.checkpoint.coordination import coord
from shardline.checkpoint.integrity.manifest import read_manifest
from shardline.checkpoint.integrity.verify import VerifyLevel
from shardline.checkpoint.provenance import records
from shardline.checkpoint.provenance.ledger import LEDGER_NAME, Ledger
from shardline.checkpoint.provenance.retention import retire
from shardline.checkpoint.provenance.run_tags import check_run_tags
from shardline.checkpoint.state.model_state import SAVE_KINDS, SaveKind
from shardline.engine import MixedPrecision, ShardingStrategy
from shardline.errors import CheckpointError, CheckpointExistsError, ConfigurationError, PublishError
from shardline.lightning.clipping import clip_globally, log_metric
from shardline.lightning.state import plain_state
from shardline.lightning.tracking import attach_run_tags, record_checkpoint

__all__ = ["ShardlineStrategy", "record_commit"]

log = logging.getLogger(__name__)

_MESH_DIM = "data_parallel"


class _Root(nn.Module):
    """The root unit around the LightningModule (see the module docstring)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


def _policy(value: Any, name: str) -> Callable[[nn.Module], bool] | None:
    """``None``, a callable ``module -> bool``, or classes / dotted class paths (one or an iterable) -> a policy."""
    if value is None:
        return None
    if isinstance(value, (str, type)):
        return shardline.layer_policy(value)
    if callable(value):
        policy: Callable[[nn.Module], bool] = value
        return policy
    if isinstance(value, Iterable):
        items = list(value)
        if items and all(isinstance(v, (str, type)) for v in items):
            return shardline.layer_policy(*items)
    raise ConfigurationError(
        f"{name} must be a module class, a dotted class path, a list of those, or a callable module -> bool; "
        f"got {type(value).__name__}: {value!r}"
    )


class ShardlineStrategy(ParallelStrategy):
    """Fully sharded data parallelism for ``lightning.Trainer``, with shardline checkpoints.

    ``Trainer(strategy=ShardlineStrategy(...))``, or ``Trainer(strategy="shardline")`` once
    ``shardline.lightning`` is imported.

    Args:
        sharding_strategy: ``"full_shard"`` (ZeRO-3, default), ``"shard_grad_op"`` (ZeRO-2),
            ``"no_shard"`` (DDP-like); Lightning/FSDP spellings (``"FULL_SHARD"``) work too.
        auto_wrap_policy: Which submodules become units: a class, a dotted class path, a list of
            those, or a callable ``module -> bool``. ``None``: the whole model is one unit.
        activation_checkpointing_policy: Which submodules recompute activations in backward
            (same forms).
        mixed_precision: A ``shardline.MixedPrecision`` (parameter / reduction / buffer dtypes).
        state_dict_type: Checkpoint layout: ``"sharded"`` (every rank writes its shards) or
            ``"full"`` (gathered; rank 0 writes). Both reload at any world size.
        reshard_after_forward: Free gathered parameters after forward (``None``: the strategy's default).
        device_mesh: The data-parallel ranks: ``None`` (all), a 1-D ``DeviceMesh``, or a 2-D one
            whose other dimension has size 1 (its ``"data_parallel"`` dimension is used).
        verify: How checkpoints are checked before loading: ``"full"`` (default: every byte hashed
            against the manifest before anything is used), or the recorded opt-ins ``"sizes"`` and
            ``"none"`` (see docs/checkpoints.md, "Verification levels").
        log_grad_norm: Name under which the global gradient norm is logged every step (``None``: not logged).
        process_group_backend: ``gloo``/``nccl`` (default: from the device).
        timeout: Collective timeout.
        run_tags: ``{key: value}`` strings the run is filed under (``{"ticket": "ABC-1"}``), recorded in
            every checkpoint's manifest and attached to the runs of the trainer's ``MLFlowLogger``,
            ``WandbLogger`` and ``TensorBoardLogger``, where each committed checkpoint is recorded too
            (:mod:`shardline.lightning.tracking`).
    """

    strategy_name = "shardline"

    def __init__(
        self,
        *,
        sharding_strategy: ShardingStrategy | str = "full_shard",
        auto_wrap_policy: Any = None,
        activation_checkpointing_policy: Any = None,
        mixed_precision: MixedPrecision | None = None,
        state_dict_type: SaveKind = "sharded",
        reshard_after_forward: bool | None = None,
        device_mesh: DeviceMesh | None = None,
        verify: VerifyLevel | str = VerifyLevel.FULL,
        log_grad_norm: str | None = "grad_norm",
        process_group_backend: str | None = None,
        timeout: datetime.timedelta | None = datetime.timedelta(minutes=30),
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Precision | None = None,
        run_tags: Mapping[str, str] | None = None,
    ) -> None:
        self.run_tags = check_run_tags(run_tags, where="run_tags")
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.sharding_strategy = ShardingStrategy.parse(sharding_strategy)
        self.auto_wrap_policy = _policy(auto_wrap_policy, "auto_wrap_policy")
        self.activation_checkpointing_policy = _policy(
            activation_checkpointing_policy, "activation_checkpointing_policy"
        )
        if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
            raise ConfigurationError(
                f"mixed_precision must be a shardline.MixedPrecision, got {type(mixed_precision).__name__}; for "
                "autocast pass Trainer(precision='bf16-mixed')"
            )
        self.mixed_precision = mixed_precision
        if state_dict_type not in SAVE_KINDS:
            raise ConfigurationError(f"state_dict_type={state_dict_type!r}; use 'sharded' or 'full'")
        self.state_dict_type = state_dict_type
        if reshard_after_forward not in (None, True, False):
            raise ConfigurationError(
                f"reshard_after_forward must be True, False or None, got {reshard_after_forward!r}"
            )
        self.reshard_after_forward = reshard_after_forward
        self.verify = VerifyLevel.parse(verify)
        self.log_grad_norm_as = log_grad_norm
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._requested_mesh = device_mesh
        self._device_mesh: DeviceMesh | None = None
        self._parent_manifest_hash: str | None = None
        self.num_nodes = 1

    # ------------------------------------------------------------------ placement
    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        """Tells Lightning to split the data across ranks (a DistributedSampler)."""
        return True

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # checkpoints load into the sharded model and its optimizer

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restores the optimizer itself

    @property
    def device_mesh(self) -> DeviceMesh:
        """The 1-D mesh of the data-parallel ranks (available from ``configure_model`` on)."""
        if self._device_mesh is None:
            raise RuntimeError("the device mesh exists once the processes have joined (after setup_environment)")
        return self._device_mesh

    @property
    def precision_plugin(self) -> Precision:
        if self._precision_plugin is None:
            self._precision_plugin = clip_globally(Precision(), self)
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        self._precision_plugin = clip_globally(plugin, self) if plugin is not None else None

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)

    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        self._init_process_group()
        self._device_mesh = self._data_parallel_mesh()
        # Lightning shows the mesh to configure_model as `self.device_mesh` through this attribute.
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

    def _init_process_group(self) -> None:
        if dist.is_initialized():
            if dist.get_world_size() != self.world_size:
                raise ConfigurationError(
                    f"torch.distributed already runs {dist.get_world_size()} processes, but the Trainer asks for "
                    f"{self.world_size} (devices x num_nodes); make them equal"
                )
            return
        env = self.cluster_environment
        assert env is not None
        os.environ.setdefault("MASTER_ADDR", env.main_address)
        os.environ.setdefault("MASTER_PORT", str(env.main_port))
        backend = self._process_group_backend or ("nccl" if self.root_device.type == "cuda" else "gloo")
        kwargs: dict[str, Any] = {"timeout": self._timeout} if self._timeout is not None else {}
        dist.init_process_group(backend, rank=self.global_rank, world_size=self.world_size, **kwargs)

    def _data_parallel_mesh(self) -> DeviceMesh:
        mesh = self._requested_mesh
        if mesh is None:
            return init_device_mesh(self.root_device.type, (self.world_size,), mesh_dim_names=(_MESH_DIM,))
        if mesh.ndim == 1:
            return mesh
        names = mesh.mesh_dim_names or ()
        others = [mesh.size(i) for i, n in enumerate(names) if n != _MESH_DIM]
        if mesh.ndim == 2 and _MESH_DIM in names and all(size == 1 for size in others):
            return mesh[_MESH_DIM]
        raise ConfigurationError(
            f"ShardlineStrategy shards over one data-parallel dimension; got a {mesh.ndim}-D mesh of shape "
            f"{tuple(mesh.shape)} (dims {names}). Pass a 1-D mesh, or a 2-D one with a '{_MESH_DIM}' dimension "
            "and size 1 elsewhere (tensor parallelism is not supported)."
        )

    # ------------------------------------------------------------------ model
    @contextlib.contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # Built on meta with empty_init=True; shardline.materialize allocates only this rank's shards.
        meta = torch.device("meta") if empty_init else contextlib.nullcontext()
        with meta, self.precision_plugin.tensor_init_context():
            yield

    def model_to_device(self) -> None:
        assert self.model is not None
        if not any(p.is_meta for p in self.model.parameters()):
            self.model.to(self.root_device)

    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None
        assert self.model is not None
        for callback in getattr(trainer, "checkpoint_callbacks", []):
            if getattr(callback, "save_last", None) is True:  # caught here, not at the second save
                raise ConfigurationError(
                    "ModelCheckpoint(save_last=True) rewrites last.ckpt at every save, and shardline never "
                    "overwrites a checkpoint; use save_last='link' (last.ckpt links to the newest checkpoint)"
                )
        attach_run_tags(trainer, self.run_tags)
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model = self._shard(self.model)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self._reset_optimizers_and_schedulers()
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    def _shard(self, module: nn.Module) -> nn.Module:
        if isinstance(module, _Root):
            return module  # set up again (fit, then validate): already sharded
        if isinstance(module, shardline.ShardedModule):
            raise ConfigurationError(
                f"configure_model sharded the LightningModule {type(module).__name__} itself; shard its submodules "
                "only (shardline.fully_shard / shardline.wrap on the layers and the inner model) -- the strategy adds "
                "the root unit around the LightningModule"
            )
        presharded = any(isinstance(m, shardline.ShardedModule) for m in module.modules())
        kwargs: dict[str, Any] = {
            "mesh": self.device_mesh,
            "strategy": self.sharding_strategy,
            "reshard_after_forward": self.reshard_after_forward,
            "mixed_precision": self.mixed_precision,
        }
        on_meta = any(p.is_meta for p in module.parameters())
        if not on_meta and not presharded:
            module.to(self.root_device)
        if self.activation_checkpointing_policy is not None and not presharded:
            shardline.apply_activation_checkpointing(module, self.activation_checkpointing_policy)
        root = _Root(module)
        if presharded and (self.auto_wrap_policy or self.activation_checkpointing_policy):
            log.warning(
                "the model was sharded in configure_model: auto_wrap_policy and activation checkpointing ignored"
            )
        if self.auto_wrap_policy is not None and not presharded:
            shardline.wrap(root, self.auto_wrap_policy, **kwargs)
        else:
            shardline.fully_shard(root, **kwargs)
        if on_meta:
            shardline.materialize(root, device=self.root_device)
        return root

    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Gradient accumulation: no gradient collectives until the last micro-batch."""
        if isinstance(self.model, shardline.ShardedModule):
            with self.model.no_sync():
                yield
        else:
            yield

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip every gradient of the model by the global norm (``math.inf``: only compute it); returns the norm.

        A collective: one all-reduce over the data-parallel ranks.
        """
        assert self.model is not None
        return shardline.clip_grad_norm_(self.model, max_norm)

    def log_grad_norm(self, norm: torch.Tensor) -> None:
        """Log the global gradient norm under ``log_grad_norm`` (every rank holds the same value)."""
        if self.log_grad_norm_as and self.lightning_module is not None:
            log_metric(self.lightning_module, self.log_grad_norm_as, norm)

    # ------------------------------------------------------------------ collectives
    def barrier(self, name: str | None = None) -> None:
        if dist.is_initialized():
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not dist.is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if not isinstance(tensor, torch.Tensor) or not dist.is_initialized() or dist.get_world_size(group) == 1:
            return tensor
        ops = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
               "min": dist.ReduceOp.MIN}  # fmt: skip
        op = ops[reduce_op.lower()] if isinstance(reduce_op, str) else (reduce_op or dist.ReduceOp.SUM)
        out = tensor.detach().clone() if tensor.dtype.is_floating_point else tensor.detach().float()
        dist.all_reduce(out, op=op, group=group)
        if isinstance(reduce_op, str) and reduce_op.lower() in ("mean", "avg"):
            out /= dist.get_world_size(group)
        return out

    def teardown(self) -> None:
        assert self.cluster_environment is not None
        assert self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    # ------------------------------------------------------------------ checkpoints
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's sharded state dict (DTensor pieces, no copy); save_checkpoint writes it through shardline."""
        assert self.model is not None
        return {k.removeprefix("module."): v for k, v in ckpt.model_state_dict(self.model).items()}

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's sharded state dict, keyed by parameter name (no communication)."""
        assert self.model is not None
        return ckpt.optimizer_state_dict(self.model, getattr(optimizer, "_optimizer", optimizer))

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Nothing to do: :meth:`load_checkpoint` has loaded the model."""

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Nothing to do: :meth:`load_checkpoint` has loaded the optimizer."""

    def _single_optimizer(self) -> torch.optim.Optimizer | None:
        if len(self.optimizers) > 1:
            raise ConfigurationError(
                f"ShardlineStrategy checkpoints one optimizer; this LightningModule has {len(self.optimizers)}. "
                "Use one optimizer with several parameter groups."
            )
        return self.optimizers[0] if self.optimizers else None

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Save ``checkpoint`` as a shardline checkpoint directory at ``filepath`` (a collective).

        The model and optimizer go in as shards (or gathered, with ``state_dict_type="full"``);
        the rest of Lightning's checkpoint (loops, callbacks, schedulers, hyper-parameters) as
        trainer state, with every rank's RNG state. The checkpoint is chained to the one saved
        or loaded before it and recorded in ``lineage.sqlite`` in its parent directory. An
        existing path is never overwritten.
        """
        if storage_options is not None:
            raise ConfigurationError(
                "ShardlineStrategy.save_checkpoint takes no storage_options (it writes a directory)"
            )
        assert self.model is not None
        path = Path(self.broadcast(os.fspath(filepath))).absolute()
        state = dict(checkpoint)
        state.pop("state_dict", None)
        optimizer = self._single_optimizer() if state.pop("optimizer_states", None) is not None else None
        trainer_state = plain_state(state)
        trainer_state["per_rank"] = {"rng": ckpt.capture_rng_state()}
        try:
            info = ckpt.save(
                path,
                model=self.model,
                optimizer=optimizer,
                state=trainer_state,
                step=int(checkpoint.get("global_step", 0)),
                kind=self.state_dict_type,
                parent_manifest_hash=self._parent_manifest_hash,
                run_tags=self.run_tags,
            )
        except CheckpointExistsError as exc:
            raise CheckpointExistsError(
                f"{exc} With ModelCheckpoint, use save_last='link' (a link to the newest checkpoint) instead of "
                "save_last=True, and file names that differ per save (the default includes epoch and step)."
            ) from None
        self._parent_manifest_hash = info.manifest_hash  # committed: the next save chains to it in any case
        record_commit(path, info)
        record_checkpoint(self.lightning_module.trainer if self.lightning_module is not None else None, path)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Verify and load a shardline checkpoint into the sharded model (and optimizer, when fitting), any world size.

        Returns the rest of the Lightning checkpoint (loops, callbacks, schedulers...) for
        Lightning to restore; restores this rank's RNG state when the checkpoint has one for it.
        """
        assert self.model is not None
        assert self.lightning_module is not None
        path = Path(self.broadcast(os.fspath(checkpoint_path)))
        # Rank 0 reads the manifest for everyone; a manifest it cannot read fails every rank with its error, not
        # rank 0 alone while the others wait in a broadcast (coord.rank0_decides).
        manifest = coord.rank0_decides(
            lambda: read_manifest(path) if (path / "manifest.json").is_file() else None, None
        )
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        has_optimizer = bool(manifest and manifest[0].get("contents", {}).get("optimizer"))
        optimizer = self._single_optimizer() if fitting and has_optimizer else None
        state = ckpt.load(
            path,
            model=self.model,
            optimizer=optimizer,
            verify=self.verify,
            strict=self.lightning_module.strict_loading,
        )
        per_rank = state.pop("per_rank", None)
        if per_rank is not None:
            ckpt.restore_rng_state(per_rank["rng"])
        self._parent_manifest_hash = manifest[1] if manifest else None
        return state

    def remove_checkpoint(self, filepath: Any) -> None:
        """Delete a checkpoint ``ModelCheckpoint`` prunes (``save_top_k``), behind a tombstone row (a collective).

        Rank 0 records the deletion in ``lineage.sqlite`` beside it first, as retention does, so the
        chain still verifies; an error reaches every rank.
        """
        path = Path(self.broadcast(os.fspath(filepath))).absolute()

        def retire_it() -> None:
            retire(path, ledger=Ledger(path.parent / LEDGER_NAME), reason="pruned by ModelCheckpoint (save_top_k)")

        coord.rank0_decides(retire_it, None)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            "shardline", cls, description="shardline: fully sharded data parallelism with verifiable checkpoints",
            override=True,
        )  # fmt: skip


def record_commit(path: Path, info: ckpt.CheckpointInfo, group: dist.ProcessGroup | None = None) -> None:
    """Append a committed checkpoint's row to ``lineage.sqlite`` beside it (a collective: rank 0 writes, and every
    rank learns the outcome, so a failed append raises on every rank instead of leaving peers in a barrier).

    Raises:
        PublishError: the append failed; the checkpoint is committed and the next save chains to it.
    """

    def append() -> None:  # nothing but the outcome crosses ranks
        records.record_commit(Ledger(path.parent / LEDGER_NAME), info, recovered=False, statement=False)

    try:
        coord.rank0_decides(append, group)
    except CheckpointError as e:
        raise PublishError(
            f"checkpoint {path} committed (manifest {info.manifest_hash[:12]}), but recording it in "
            f"{path.parent / LEDGER_NAME} failed ({e}); the next save chains to it. Fix the cause, then run "
            f"`shardline lineage {path.parent} --new-chain` if the ledger no longer verifies.",
            info=info,
        ) from e


# Importing shardline.lightning makes Trainer(strategy="shardline") available.
ShardlineStrategy.register_strategies(StrategyRegistry)
