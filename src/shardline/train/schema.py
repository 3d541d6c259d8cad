"""Typed schemas behind every config node of ``shardline train``.

Composed YAML is merged onto these dataclasses in struct mode, so a misspelled key or a value
of the wrong type is an error naming the key -- never a silently ignored setting. Each field's
docstring is its documentation (``shardline train --help-config`` lists them). The composed
config becomes a :class:`TrainConfig` instance (:func:`shardline.train.config.to_train_config`),
which is what the launcher checks and every worker receives.

Note: enumerated settings. OmegaConf 2.3 cannot hold a ``Literal`` field, and its enum fields
accept member names only (``FULL_SHARD``), not the values and aliases users type
(``full_shard``, ``zero3``). So those fields stay ``str`` for Hydra, and each is checked in
``__post_init__`` of its dataclass -- when the composed config becomes a ``TrainConfig`` --
against the one definition of its choices: a ``Literal`` here for the settings this module
owns (:data:`Accelerator`, :data:`InitDevice`), and the owner's enum or ``Literal`` otherwise
(:class:`~shardline.engine.ShardingStrategy`, :data:`~shardline.checkpoint.state.model_state.SaveKind`,
:data:`~shardline.train.precision.Precision`, :class:`~shardline.checkpoint.integrity.verify.VerifyLevel`,
:data:`~shardline.train.data.sources.DataSource`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from hydra.core.config_store import ConfigStore

from shardline.checkpoint.coordination.parallelism import resolve_files_per_rank
from shardline.checkpoint.format.packed_layout import DEFAULT_SEGMENT_BYTES, CheckpointLayout
from shardline.checkpoint.integrity.verify import VerifyLevel
from shardline.checkpoint.lifecycle.capture import check_layout_options
from shardline.checkpoint.provenance.run_tags import check_run_tags
from shardline.checkpoint.state.model_state import SAVE_KINDS
from shardline.engine import ShardingStrategy
from shardline.errors import ConfigurationError
from shardline.train.data.sources import check_source
from shardline.train.precision import check_precision
from shardline.train.redaction import redact_config

__all__ = [
    "ACCELERATORS",
    "INIT_DEVICES",
    "NO_SHARDING",
    "Accelerator",
    "CheckpointConfig",
    "DataConfig",
    "InitDevice",
    "OptimizerConfig",
    "SchedulerConfig",
    "StrategyConfig",
    "TrackingConfig",
    "TrainConfig",
    "TrainerConfig",
    "register_schemas",
]

Accelerator = Literal["auto", "cpu", "cuda"]
"""``trainer.accelerator``: auto (cuda if available, else cpu), cpu or cuda."""
ACCELERATORS: tuple[str, ...] = get_args(Accelerator)
InitDevice = Literal["cpu", "meta"]
"""``trainer.init_device``: build the model on CPU, or on the meta device and materialize only local shards."""
INIT_DEVICES: tuple[str, ...] = get_args(InitDevice)
NO_SHARDING = "none"
"""``trainer.strategy.sharding_strategy`` of the single_device strategy: one process, the model not wrapped."""


def _check_choice(key: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigurationError(f"{key}={value!r}; use one of {', '.join(choices)}")


@dataclass
class StrategyConfig:
    """How the model is distributed (the ``trainer_strategy`` group; model-agnostic)."""

    name: str = "fsdp"
    """Which base strategy config this is: fsdp, zero2, zero1, ddp, hsdp or single_device."""
    sharding_strategy: str = "full_shard"
    """full_shard (ZeRO-3), shard_grad_op (ZeRO-2), shard_opt (ZeRO-1), no_shard (ZeRO-0 / DDP), hybrid_shard or
    hybrid_shard_zero2 (on a replicate x shard mesh), or none (single device, no wrapping)."""
    reshard_after_forward: Any = None
    """Free gathered parameters after forward: true, false, null for the strategy's default, or an int N dividing
    the shard group's size: keep them split over groups of N ranks, so backward gathers inside such a group."""
    replicate_size: int = -1
    """Hybrid strategies: how many replicas of each shard (-1: world size / shard_size)."""
    shard_size: int = -1
    """Hybrid strategies: ranks each model replica is sharded over, consecutive ranks (-1: world size /
    replicate_size). replicate_size x shard_size must equal devices x num_nodes."""
    state_dict_type: str = "sharded"
    """Checkpoint layout: sharded (torch DCP, any world size) or full (gathered on rank 0)."""
    cpu_offload: bool = False
    """Keep the sharded parameters, their gradients and the optimizer state in host memory (pinned on CUDA): each
    unit's shard is copied to the device for its all-gather and the optimizer steps on the host
    (:class:`shardline.CPUOffload`). Less device memory, more host traffic; the same numerics. Not with zero1 or
    single_device."""
    use_orig_params: bool = True
    """Accepted for configs written for torch FSDP: shardline always exposes the original parameters (each as
    its shard), which is what true means; false (FSDP1's flat parameters) is refused."""
    auto_wrap_policy: Any = None
    """Which modules become units, e.g. {_target_: shardline.layer_policy, _args_: [pkg.Block]} (model-specific)."""
    activation_checkpointing_policy: Any = None
    """Which modules recompute activations in backward, same form as auto_wrap_policy."""
    mixed_precision: Any = None
    """A shardline.MixedPrecision (via _target_); decides parameter, reduction and buffer dtypes."""

    def __post_init__(self) -> None:
        _ = self.sharding  # an unknown name raises here, naming the choices
        raf = self.reshard_after_forward
        if raf is not None and not isinstance(raf, bool) and (not isinstance(raf, int) or raf < 1):
            raise ConfigurationError(
                "trainer.strategy.reshard_after_forward must be true, false, null or a positive int dividing the "
                f"shard group's size, got {raf!r}"
            )
        _check_choice("trainer.strategy.state_dict_type", self.state_dict_type, SAVE_KINDS)
        if self.use_orig_params is not True:
            raise ConfigurationError(
                f"trainer.strategy.use_orig_params={self.use_orig_params!r}: shardline always trains the original "
                "parameters (each rank's shard of each, as its own nn.Parameter); torch FSDP1's flattened parameters "
                "(use_orig_params=false) do not exist here. Set trainer.strategy.use_orig_params=true or drop the key."
            )

    @property
    def sharding(self) -> ShardingStrategy | None:
        """The engine's strategy, or None for :data:`NO_SHARDING` (single device: the model is not wrapped).

        Raises:
            ConfigurationError: an unknown strategy name (naming the choices).
        """
        if self.sharding_strategy == NO_SHARDING:
            return None
        return ShardingStrategy.parse(self.sharding_strategy)


@dataclass
class TrainerConfig:
    """The training loop and how it is launched."""

    devices: int = 2
    """Workers on this node (processes; one per GPU on CUDA)."""
    num_nodes: int = 1
    """Nodes in the job; more than one requires launching with torchrun on every node."""
    accelerator: str = "auto"
    """auto (cuda if available, else cpu), cpu or cuda; decides the backend (gloo or nccl)."""
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    precision: str = "32-true"
    """32-true (no autocast), bf16-mixed (autocast to bf16 around forward and loss) or 16-mixed (autocast to
    fp16, with a loss scaler whose overflow verdict all ranks share)."""
    max_steps: int = 600
    """Optimizer steps to run."""
    micro_batch_size: int = 8
    """Sequences per rank per micro-batch."""
    accumulate_grad_batches: int = 2
    """Micro-batches per optimizer step; all but the last run under no_sync. Re-derived on a resume at another
    world size (and whenever trainer.global_batch_size is set) so that the global batch stays the same."""
    global_batch_size: int = 0
    """Sequences per optimizer step over all ranks; 0: micro_batch_size x accumulate_grad_batches x world size at
    the first start. Fixed for the run: every checkpoint records it and a resume at any world size keeps it."""
    gradient_clip_val: float = 1.0
    """Clip the global gradient norm to this value (0 disables clipping; the norm is still logged)."""
    val_check_interval: int = 100
    """Evaluate on the validation split every this many steps (and at the first and last step)."""
    val_batches: int = 4
    """Global validation batches per evaluation."""
    log_every_n_steps: int = 10
    """Read losses and norms from the device (one transfer), write their metrics rows and print the
    plain-text progress line (when the output is not a terminal) every this many steps; also at
    evaluations, checkpoints and the last step."""
    seed: int = 1234
    """Seed for model initialization, data order and dropout."""
    init_device: str = "cpu"
    """cpu: build the model on CPU; meta: build on the meta device and materialize only local shards."""
    compile: bool = False
    """torch.compile each sharded unit (each wrapped block; the whole model when it is one unit or not sharded).
    Equal to eager within rounding; the first step is slower while it compiles."""
    collective_timeout_s: float = 300.0
    """Seconds a collective may wait before the job fails instead of hanging."""
    preemption_grace_s: float = 120.0
    """After SIGTERM (a preemption notice, torchrun's restart): seconds to finish the step in flight and save it
    as step-N-preempted; at the deadline the worker exits at once (repeated SIGTERMs are ignored)."""
    run_root: str = "runs"
    """Run directories are created as <run_root>/<experiment>/<timestamp>/."""
    run_dir: Any = None
    """Use exactly this run directory instead (must not exist or be empty, unless resuming)."""
    resume: Any = None
    """null; auto (continue the newest run of this experiment, or trainer.run_dir, from its newest committed
    checkpoint; start fresh if there is none); or the path of a committed checkpoint (a new run branches from it)."""

    def __post_init__(self) -> None:
        _check_choice("trainer.accelerator", self.accelerator, ACCELERATORS)
        check_precision(self.precision)
        _check_choice("trainer.init_device", self.init_device, INIT_DEVICES)


@dataclass
class DataConfig:
    """The corpus and how batches are cut from it (see docs/your_own.md)."""

    name: str = "stdlib"
    """Source: stdlib (this Python's standard library sources, offline), text (text files), jsonl (JSON lines),
    tokens (a pre-tokenized .bin/.npy array, memory-mapped), hf (a local Hugging Face dataset)."""
    path: Any = None
    """text/jsonl: a glob of your files (or a list of globs; ** recurses); tokens: the .bin or .npy file; hf: a
    save_to_disk folder, or parquet/arrow/jsonl/json/csv files (a glob, a list, or a folder of them)."""
    val_path: Any = None
    """Validation data of the same kind; default: hold out about one document (tokens: the last part) in val_every."""
    text_field: str = "text"
    """jsonl: the field of each JSON object that holds the text."""
    text_column: str = "text"
    """hf: the column that holds the text (one row, one document)."""
    split: Any = None
    """hf: the split of data.path to read (default: train, or the dataset's only split)."""
    tokenizer: Any = None
    """A tokenizer.json file or a folder for transformers.AutoTokenizer (local, nothing downloaded); null: bytes."""
    eos_token: Any = None
    """The token that separates documents (default: the tokenizer's end-of-sequence token, if it has one)."""
    token_dtype: str = "uint16"
    """tokens: element type of a raw .bin file (uint16 as nanoGPT writes it, uint32, int32 or int64)."""
    root: Any = None
    """stdlib: a directory of .py files to read instead of the standard library."""
    max_bytes: int = 4_000_000
    """stdlib: size of the training split in bytes (the validation split is about 1/val_every of it)."""
    val_every: int = 20
    """About one file (or document) in val_every goes to the validation split."""
    seq_len: int = 128
    """Tokens per training sequence (bytes for the stdlib corpus)."""

    def __post_init__(self) -> None:
        check_source(self.name)


@dataclass
class OptimizerConfig:
    """AdamW hyper-parameters."""

    lr: float = 3e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1


@dataclass
class SchedulerConfig:
    """Learning-rate schedule: linear warmup, then cosine decay."""

    warmup_steps: int = 60
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of optimizer.lr."""


@dataclass
class CheckpointConfig:
    """Where checkpoints are written (RUN_DIR/checkpoints, or a bucket), when, and how they are checked on load."""

    dir: str = ""
    """Where checkpoints go ("": RUN_DIR/checkpoints): a local directory, or an object-store URL
    (s3://BUCKET/PREFIX; each checkpoint lands in PREFIX/step-N). The lineage ledger stays in RUN_DIR."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """Options of the fsspec file system of a URL dir (e.g. endpoint_url, key, secret); default: the AWS
    environment (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...). Credentials among them are used, never recorded:
    config.yaml, manifests and trackers show them as <redacted>."""

    every_n_steps: int = 0
    """Save every this many steps (0: no periodic checkpoints)."""
    save_last: bool = True
    """Save after the last step."""
    save_on_exception: bool = True
    """Save a step-N-on_exception checkpoint when the loss diverges (seen by every rank)."""
    async_save: bool = False
    """Write checkpoints in a background thread while training continues (the bytes written are checked against
    the bytes staged)."""
    keep_last_n: int = 0
    """Keep only the newest N regular checkpoints (0: keep all); older ones are deleted after a newer one commits,
    each recorded by a tombstone row in the ledger."""
    keep_best_k: int = 0
    """Also keep the K checkpoints with the best `monitor` value (0: none kept as best); with keep_last_n, the
    union is kept, and always the newest checkpoint (to resume from). Deletions leave tombstone rows as above."""
    monitor: str = ""
    """The metric that ranks checkpoints for keep_best_k: val_loss (the validation loss of the saved step; a
    checkpoint saved at a step without an evaluation has none and is never kept as best) or loss (training loss)."""
    mode: str = "min"
    """min (lower is better, e.g. a loss) or max (higher is better)."""
    verify: str = VerifyLevel.FULL.value
    """On resume: full (every byte hashed against the manifest), or the opt-ins sizes (file sizes only) and none;
    an opt-in is printed and recorded in the ledger."""
    files_per_rank: int = 0
    """Files each rank writes per checkpoint, each hashed by its own writer thread and verified on its own reader
    thread (0: the cores each rank has on its node, at most 8)."""
    layout: str = CheckpointLayout.PER_TENSOR.value
    """How sharded checkpoints store their tensors: per_tensor (DCP's chunk per rank and tensor, any DCP reader) or
    packed (each rank's row shards in a few segments: metadata O(ranks + tensors), for thousands of ranks)."""
    segment_bytes: int = DEFAULT_SEGMENT_BYTES
    """The packed layout's segment size in bytes (default 256 MiB)."""

    def __post_init__(self) -> None:
        try:
            VerifyLevel.parse(self.verify)
        except ConfigurationError as exc:
            raise ConfigurationError(f"checkpoint.verify={self.verify!r}: {exc}") from None
        try:
            resolve_files_per_rank(self.files_per_rank)
        except ConfigurationError as exc:
            raise ConfigurationError(f"checkpoint.{exc}") from None
        try:
            check_layout_options(CheckpointLayout.parse(self.layout), self.segment_bytes, kind="sharded")
        except ConfigurationError as exc:
            raise ConfigurationError(
                f"checkpoint.layout={self.layout!r}, segment_bytes={self.segment_bytes!r}: {exc}"
            ) from None


@dataclass
class TrackingConfig:
    """What experiment trackers and checkpoints record about the run, besides its config and metrics."""

    tags: dict[str, str] = field(default_factory=dict)
    """Run tags a team files runs under, e.g. {project: lm, ticket: ABC-1, dataset_licence: cc-by-4.0, owner: ana};
    on the command line tracking.tags.ticket=ABC-1. Recorded in every checkpoint's manifest and provenance
    statement (run_tags) and attached to the MLflow / W&B run. Keys: 1-64 letters, digits, _ - . /; values:
    1-256 printable characters."""

    def __post_init__(self) -> None:
        check_run_tags(self.tags, where="tracking.tags")


@dataclass
class TrainConfig:
    """Everything ``shardline train`` needs."""

    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    model: Any = None
    """The model: {_target_: dotted.factory, ...kwargs} (set by the experiment)."""
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    callbacks: dict[str, Any] = field(default_factory=dict)
    """Named callbacks {name: {_target_: ..., ...}}; remove one with ~callbacks.NAME."""
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def to_dict(self) -> dict[str, Any]:
        """The config as plain data (what ``config.yaml`` and each checkpoint's manifest record).

        Credentials in ``checkpoint.storage_options`` are redacted (:mod:`shardline.train.redaction`);
        the run itself reads them from ``self.checkpoint``.
        """
        return redact_config(dataclasses.asdict(self))


def register_schemas() -> None:
    """Register the root schema with Hydra's ConfigStore (idempotent)."""
    ConfigStore.instance().store(name="shardline_schema", node=TrainConfig)
