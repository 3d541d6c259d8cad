"""The training loop: one class that sets up the model, data and optimizer, then fits.

Note: no host synchronization inside a step. Reading a CUDA tensor on the host (``float(loss)``,
``.item()``, ``bool(torch.isfinite(x))``) stalls the CPU until the GPU has drained every kernel
queued before it, so the CPU can no longer run ahead launching the next step's work. A step
therefore keeps its global loss and gradient norm as device tensors, and the loop reads them
once per *read interval* -- every ``trainer.log_every_n_steps`` steps, and at every evaluation,
checkpoint and the last step -- in one transfer for the whole interval. ``metrics.csv`` still
gets one row per step (``step_time_s`` is then the interval's wall time per step, which includes
the device draining).

The divergence guarantee holds without a read: each step decides *on the device* whether its
update applies, as fused optimizers do with ``found_inf`` under a gradient scaler. A
non-finite global loss or gradient norm sets a sticky flag tensor, which the optimizer
(``AdamW(fused=True)``) reads inside its kernel: the weights, the moments and the step count
stay as they were, for this step and every later one of the interval. At the read the run
stops with :class:`TrainingDiverged` naming the first bad step; the LR scheduler is put back to
that step, so an ``on_exception`` checkpoint holds the state after the last good step.
"""

from __future__ import annotations

import contextlib
import csv
import logging
import math
import resource
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardline
from shardline.distributed import DistInfo
from shardline.engine import apply_activation_checkpointing, subtree_units
from shardline.train.build import Policies, build_model
from shardline.train.checkpointing import TrainingCheckpoints, TrainingDiverged
from shardline.train.compiling import compile_units
from shardline.train.config import shard_degrees
from shardline.train.data import Corpus, check_vocab, load_corpus, make_batches
from shardline.train.global_batch import plan_global_batch
from shardline.train.hooks import Hook, check_callbacks
from shardline.train.precision import autocast
from shardline.train.preemption import PREEMPTED, Preempted, PreemptionGuard
from shardline.train.records import METRICS_FILE
from shardline.train.schema import TrainConfig

__all__ = ["StepMetrics", "Summary", "Trainer"]

log = logging.getLogger("shardline.train")

_EVAL_SEED = 0x5EED


@dataclass
class StepMetrics:
    """What one optimizer step measured (``val_loss`` only at evaluation steps).

    ``skipped``: the update was not applied -- fp16 gradients overflowed on some rank and the loss
    scale was lowered (``16-mixed``); ``loss`` is the one measured, ``grad_norm`` None (that norm
    is not a number, and NaN is not valid JSON).
    """

    step: int
    loss: float
    lr: float
    grad_norm: float | None
    tokens_per_s: float
    step_time_s: float
    peak_mem_mib: float
    comm_mib: float = 0.0
    val_loss: float | None = None
    world_size: int = 0
    data_digest: str = ""
    skipped: bool = False


@dataclass
class Summary:
    """The outcome of a run (written to ``summary.json``)."""

    experiment: str
    run_dir: str
    world_size: int
    strategy: str
    precision: str
    model_parameters: int
    steps: int
    tokens: int
    wall_time_s: float
    median_tokens_per_s: float
    initial_val_loss: float
    final_val_loss: float
    best_val_loss: float
    final_train_loss: float
    peak_mem_mib: float
    corpus: str
    corpus_sha256: str
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _PendingStep:
    """A step whose loss and gradient norm are still device tensors (read at the interval's end)."""

    step: int
    lr: float
    loss: torch.Tensor
    grad_norm: torch.Tensor
    peak_mem_mib: float
    comm_mib: float
    scheduler_before: dict[str, Any]
    data_digest: str
    overflow: torch.Tensor  # 1: fp16 gradients overflowed on some rank, the update was skipped


def _peak_mem_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _read_metrics(path: Path, *, upto: int) -> list[StepMetrics]:
    """The metrics of steps 1..``upto`` (the resumed step) from earlier attempts' ``metrics.csv``.

    Where attempts overlap, a step's newest row wins (it is the one the resumed state descends from).
    """
    if not path.is_file():
        return []
    out: dict[int, StepMetrics] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            step = int(row["step"])
            if 0 < step <= upto and row["loss"]:
                out[step] = StepMetrics(
                    step=step,
                    loss=float(row["loss"]),
                    lr=float(row["lr"]),
                    grad_norm=float(row["grad_norm"]) if row["grad_norm"] else None,
                    tokens_per_s=float(row["tokens_per_s"]),
                    step_time_s=float(row["step_time_s"]),
                    peak_mem_mib=float(row["peak_mem_mib"]),
                    comm_mib=float(row.get("comm_mib") or 0.0),
                    val_loss=float(row["val_loss"]) if row["val_loss"] else None,
                    world_size=int(row.get("world_size") or 0),
                    data_digest=row.get("data_digest") or "",
                    skipped=row.get("skipped") == "True",
                )
    return [out[step] for step in sorted(out)]


def lr_lambda(step: int, *, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup to 1, then cosine decay to ``min_ratio`` at ``total`` steps."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class Trainer:
    """Builds everything from the config on every rank and runs the loop.

    Attributes readable by callbacks: ``cfg`` (the run's :class:`~shardline.train.schema.TrainConfig`),
    ``info`` (rank, world size, device), ``run_dir``,
    ``experiment``, ``model``, ``corpus``, ``metrics`` (all :class:`StepMetrics` so far),
    ``is_rank0``.
    """

    def __init__(
        self,
        cfg: TrainConfig,
        *,
        info: DistInfo,
        run_dir: Path,
        experiment: str,
        policies: Policies,
        callbacks: list[object],
    ) -> None:
        check_callbacks(callbacks)  # a misspelt hook would never be called
        self.cfg = cfg
        self.info = info
        self.run_dir = run_dir
        self.experiment = experiment
        self.policies = policies
        self.callbacks = callbacks
        self.is_rank0 = info.rank == 0
        self.metrics: list[StepMetrics] = []
        self.val_history: list[tuple[int, float]] = []
        sharding = cfg.trainer.strategy.sharding
        self.sharded = sharding is not None
        self.hybrid = sharding is not None and sharding.policy.hybrid
        self.device = info.device
        self.precision = cfg.trainer.precision
        self.max_steps = cfg.trainer.max_steps
        self._skip = torch.zeros((), device=self.device)  # 1 once a step was not finite: no update after it
        self._no_overflow = torch.zeros((), device=self.device)
        self._overflow = self._no_overflow  # the last step's verdict, read with its loss

        torch.manual_seed(cfg.trainer.seed)
        self.corpus: Corpus = load_corpus(cfg.data)
        log.info("corpus: %s", self.corpus.describe())
        self.model = self._build_model()
        self.optimizer = self._build_optimizer()
        # 16-mixed: fp16 gradients need loss scaling; an overflow skips the step on every rank (not a divergence).
        self.scaler = shardline.ShardedGradScaler(self.model) if self.precision == "16-mixed" else None
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda s: lr_lambda(
                s, warmup=cfg.scheduler.warmup_steps, total=self.max_steps, min_ratio=cfg.scheduler.min_lr_ratio
            ),
        )
        # Dropout and other per-rank randomness: distinct per rank, reproducible per seed.
        torch.manual_seed(cfg.trainer.seed + 1 + info.rank)
        self.checkpoints = TrainingCheckpoints(cfg, run_dir)
        self.start_step = self.checkpoints.resume(self, cfg.trainer.resume)
        # The global batch is the run's, recorded by the checkpoint a resume loaded; only the
        # accumulation steps follow the world size (see shardline.train.global_batch).
        self.batch_plan = plan_global_batch(
            micro_batch=cfg.trainer.micro_batch_size,
            accumulate=cfg.trainer.accumulate_grad_batches,
            world_size=info.world_size,
            configured=cfg.trainer.global_batch_size,
            recorded=self.checkpoints.recorded_global_batch,
        )
        self.accumulate = self.batch_plan.accumulate
        self.global_batch = self.batch_plan.global_batch
        self.tokens_per_step = self.global_batch * cfg.data.seq_len
        if self.accumulate != cfg.trainer.accumulate_grad_batches:
            log.info(
                "global batch %d at world size %d: %d accumulation steps of %d (trainer.accumulate_grad_batches=%d "
                "is re-derived)",
                self.global_batch,
                info.world_size,
                self.accumulate,
                cfg.trainer.micro_batch_size,
                cfg.trainer.accumulate_grad_batches,
            )
        self.train_batches = make_batches(
            self.corpus,
            "train",
            seq_len=cfg.data.seq_len,
            global_batch=self.global_batch,
            rank=info.rank,
            world_size=info.world_size,
            seed=cfg.trainer.seed,
        )
        # Validation batches are global batches too (evaluated in micro-batches), so a
        # validation loss means the same at every world size.
        self.val_batches = make_batches(
            self.corpus,
            "val",
            seq_len=cfg.data.seq_len,
            global_batch=self.global_batch,
            rank=info.rank,
            world_size=info.world_size,
            seed=_EVAL_SEED,
        )
        self.preemption = PreemptionGuard(
            grace_s=cfg.trainer.preemption_grace_s,
            world_size=info.world_size,
            backend=info.backend,
            timeout_s=cfg.trainer.collective_timeout_s,
        )
        for group in self.optimizer.param_groups:  # a checkpoint written before the fused optimizer says otherwise
            group["fused"], group["foreach"] = True, None
        if self.start_step:
            self.metrics = _read_metrics(run_dir / METRICS_FILE, upto=self.start_step)

    # ------------------------------------------------------------------ setup
    def _build_model(self) -> nn.Module:
        cfg, policies = self.cfg, self.policies
        init_on_meta = cfg.trainer.init_device == "meta"
        model = build_model(cfg, device="meta" if init_on_meta else "cpu")
        check_vocab(self.corpus, model)
        self.model_parameters = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
        if not init_on_meta and self.device.type != "cpu":
            model.to(self.device)
        if policies.checkpointing is not None:
            names = apply_activation_checkpointing(model, policies.checkpointing)
            log.info("activation checkpointing on %d modules", len(names))
        if self.sharded:
            strategy = cfg.trainer.strategy
            kwargs = {
                "strategy": strategy.sharding,
                "reshard_after_forward": strategy.reshard_after_forward,
                "mixed_precision": policies.mixed_precision,
                "offload": shardline.CPUOffload() if strategy.cpu_offload else None,
            }
            if self.hybrid:
                replicas, shard = shard_degrees(cfg, world_size=self.info.world_size)
                kwargs["mesh"] = shardline.hybrid_mesh(
                    replicate_size=replicas, shard_size=shard, device_type=self.device.type
                )
                log.info("hybrid mesh: %d replicas x %d-rank shard groups", replicas, shard)
            if policies.wrap is not None:
                shardline.wrap(model, policies.wrap, **kwargs)
            else:
                log.warning("no trainer.strategy.auto_wrap_policy: the whole model is one unit")
                shardline.fully_shard(model, **kwargs)
            units = subtree_units(model)
            log.info("sharded into %d units (%s)", len(units), strategy.sharding_strategy)
            if strategy.cpu_offload:
                log.info("CPU offload: sharded parameters, gradients and optimizer state in host memory")
        if init_on_meta:
            torch.manual_seed(cfg.trainer.seed)  # the same draws a CPU build would make
            shardline.materialize(model, device=self.device)
        if cfg.trainer.compile:
            log.info("torch.compile on %d modules", len(compile_units(model)))
        return model

    def _build_optimizer(self) -> torch.optim.Optimizer:
        opt = self.cfg.optimizer
        decay = [p for p in self.model.parameters() if p.requires_grad and p.ndim >= 2]
        no_decay = [p for p in self.model.parameters() if p.requires_grad and p.ndim < 2]
        groups = [
            {"params": decay, "weight_decay": opt.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        # fused: the kernel reads ``found_inf`` on the device, so a diverged step skips without a host read.
        betas = cast("tuple[float, float]", tuple(opt.betas))  # two, as the config schema says
        return torch.optim.AdamW(groups, lr=opt.lr, betas=betas, eps=opt.eps, fused=True)

    @property
    def _shards(self) -> shardline.ShardedModule:
        """The model, where ``self.sharded`` (``_build_model`` sharded it)."""
        return cast(shardline.ShardedModule, self.model)

    # ------------------------------------------------------------------ loop
    def _loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with autocast(self.precision, self.device.type):
            out = self.model(self._to_device(tokens))
            logits = out.logits if hasattr(out, "logits") else out
            return F.cross_entropy(logits.flatten(0, 1).float(), self._to_device(targets).flatten())

    def _to_device(self, batch: torch.Tensor) -> torch.Tensor:
        """``batch`` on the training device; to CUDA from pinned memory, without blocking the host."""
        if self.device.type != "cuda":
            return batch.to(self.device)
        return batch.pin_memory().to(self.device, non_blocking=True)

    def _global_mean(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of ``value`` over the ranks, as a float32 device tensor (no host read)."""
        value = value.detach().to(self.device, torch.float32).clone()
        if self.info.world_size > 1:
            dist.all_reduce(value, op=dist.ReduceOp.SUM)
            value /= self.info.world_size
        return value

    def evaluate(self) -> float:
        """Mean loss over ``trainer.val_batches`` fixed validation batches (all ranks)."""
        self.model.eval()
        total = torch.zeros((), device=self.device)
        with torch.no_grad():
            for i in range(self.cfg.trainer.val_batches):
                tokens, targets = self.val_batches.local(i)
                for x, y in zip(tokens.chunk(self.accumulate), targets.chunk(self.accumulate), strict=True):
                    total += self._loss(x, y) / self.accumulate
        self.model.train()
        return float(self._global_mean(total / self.cfg.trainer.val_batches))  # a read: evaluation ends an interval

    def _train_step(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step; returns (global mean loss, global grad norm) as device tensors.

        Reads nothing on the host (see the note at the top). A non-finite loss or gradient norm
        -- the same on every rank, both being all-reduced -- makes this and every later step skip
        the update on the device; :meth:`_read` raises :class:`TrainingDiverged` for it.
        """
        self._call("on_train_batch_start", step + 1)
        tokens, targets = self.train_batches.local(step)
        micro = zip(tokens.chunk(self.accumulate), targets.chunk(self.accumulate), strict=True)
        loss_sum = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(micro):
            last = i == self.accumulate - 1
            # Hybrid sharding reduce-scatters every micro-batch (memory stays sharded) and all-reduces
            # across replicas once per step; the others skip every gradient collective until the last.
            sync = (
                contextlib.nullcontext()
                if last or not self.sharded
                else self._shards.no_sync(reduce_scatter=self.hybrid)
            )
            with sync:
                loss = self._loss(x, y) / self.accumulate
                (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
            loss_sum += loss.detach()
        self._call("on_after_backward", step + 1)
        loss = self._global_mean(loss_sum)
        max_norm = self.cfg.trainer.gradient_clip_val or math.inf
        # Without a scaler the step is as before: no verdict to copy, and the fused kernel reads the sticky skip flag.
        overflow = self.scaler.unscale_(self.optimizer).clone() if self.scaler is not None else self._no_overflow
        if self.sharded:
            grad_norm = self._shards.clip_grad_norm_(max_norm)
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        finite_norm = torch.isfinite(grad_norm)
        if self.scaler is not None:
            finite_norm = finite_norm | (overflow > 0)  # an fp16 overflow is the scaler's to handle
        bad = torch.logical_not(torch.isfinite(loss) & finite_norm).to(torch.float32)
        torch.maximum(self._skip, bad, out=self._skip)  # sticky: no update after a bad step either
        self._call("on_before_optimizer_step", step + 1)
        # read by the fused kernel: 1 skips
        found_inf = torch.maximum(self._skip, overflow) if self.scaler is not None else self._skip
        if self.cfg.trainer.strategy.cpu_offload and found_inf.device.type != "cpu":
            found_inf = found_inf.cpu()  # the optimizer steps on the host (CPU offload): a read, once per step
        self.optimizer.found_inf = found_inf  # type: ignore[attr-defined]
        self.optimizer.step()
        if self.scaler is not None:
            self.scaler.update()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._overflow = overflow
        return loss, grad_norm.detach().to(self.device, torch.float32)

    def _read(self, pending: list[_PendingStep], wall_s: float) -> list[StepMetrics]:
        """One host read for the interval's steps; raises :class:`TrainingDiverged` at the first bad one."""
        if not pending:
            return []
        values = torch.stack([t for p in pending for t in (p.loss, p.grad_norm, p.overflow)]).tolist()
        per_step = wall_s / len(pending)
        out: list[StepMetrics] = []
        for i, p in enumerate(pending):
            loss, grad_norm, overflow = values[3 * i], values[3 * i + 1], values[3 * i + 2]
            if overflow:  # recorded as skipped, without a norm: the step did not update the weights
                log.info(
                    "step %d: fp16 gradients overflowed; the update was skipped and the loss scale lowered", p.step
                )
            if not (math.isfinite(loss) and (overflow or math.isfinite(grad_norm))):
                self._rewind_scheduler(p.scheduler_before)
                bad = f"training loss became {loss}" if not math.isfinite(loss) else f"gradient norm became {grad_norm}"
                raise TrainingDiverged(
                    f"{bad} at step {p.step}; the update was skipped on the device, so the weights and optimizer "
                    f"state are those after step {p.step - 1}. Lower optimizer.lr or enable gradient clipping "
                    "(trainer.gradient_clip_val)",
                    step=p.step,
                    metrics=out,
                )
            out.append(
                StepMetrics(
                    step=p.step,
                    loss=loss,
                    lr=p.lr,
                    grad_norm=None if overflow else grad_norm,
                    tokens_per_s=self.tokens_per_step / per_step if per_step > 0 else math.inf,
                    step_time_s=per_step,
                    peak_mem_mib=p.peak_mem_mib,
                    comm_mib=p.comm_mib,
                    world_size=self.info.world_size,
                    data_digest=p.data_digest,
                    skipped=bool(overflow),
                )
            )
        return out

    def _rewind_scheduler(self, state: dict[str, Any]) -> None:
        """Put the LR schedule (and the optimizer's learning rates) back to before a step."""
        self.scheduler.load_state_dict(state)
        for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr(), strict=True):
            group["lr"] = lr

    def _emit(self, metrics: list[StepMetrics]) -> None:
        for m in metrics:
            self.metrics.append(m)
            self._call("on_step_end", m)

    def _call(self, hook: Hook, *args: object) -> None:
        for callback in self.callbacks:
            method = getattr(callback, hook, None)
            if method is not None:
                method(self, *args)

    def _call_on_exception(self, error: BaseException) -> None:
        """Tell callbacks the run failed (``on_exception``); their own errors are logged, never raised over it."""
        for callback in self.callbacks:
            method = getattr(callback, "on_exception", None)
            if method is None:
                continue
            try:
                method(self, error)
            except Exception as e:
                log.error("callback %s failed in on_exception: %s: %s", type(callback).__name__, type(e).__name__, e)

    def fit(self) -> Summary:
        """Train up to ``trainer.max_steps`` steps (from the resumed step), evaluating and saving on schedule."""
        cfg = self.cfg.trainer
        self._call("on_fit_start")
        if self.start_step == 0:
            initial_val = self.evaluate()
            self.val_history.append((0, initial_val))
            self._call("on_validation_end", 0, initial_val)
        start = time.perf_counter()
        done = self.start_step
        every_read = max(1, cfg.log_every_n_steps)
        pending: list[_PendingStep] = []
        interval_start = time.perf_counter()
        self.preemption.install()
        try:
            for step in range(self.start_step, self.max_steps):
                lr = self.optimizer.param_groups[0]["lr"]
                scheduler_before = self.scheduler.state_dict()
                comm_before = shardline.comm_stats(self.model).total_bytes
                loss, grad_norm = self._train_step(step)
                pending.append(
                    _PendingStep(
                        step=step + 1,
                        lr=lr,
                        loss=loss,
                        grad_norm=grad_norm,
                        peak_mem_mib=_peak_mem_mib(self.device),
                        comm_mib=(shardline.comm_stats(self.model).total_bytes - comm_before) / 2**20,
                        scheduler_before=scheduler_before,
                        data_digest=self.train_batches.digest(step) if self.is_rank0 else "",
                        overflow=self._overflow,
                    )
                )
                self._call("on_train_batch_end", step + 1)
                preempted = self.preemption.agreed()  # every rank stops after the same step
                last = step + 1 == self.max_steps
                validate = (step + 1) % cfg.val_check_interval == 0 or last
                save = self.checkpoints.due(step + 1, last=last)
                if not (validate or save or last or preempted or (step + 1) % every_read == 0):
                    continue
                # The interval's one read: a diverged step raises here, before anything is evaluated or saved.
                try:
                    metrics = self._read(pending, time.perf_counter() - interval_start)
                except TrainingDiverged as diverged:
                    self._emit(diverged.metrics)
                    done = diverged.step - 1
                    raise
                pending = []
                done = step + 1
                val_loss = None
                if validate:
                    val_loss = self.evaluate()
                    self.val_history.append((done, val_loss))
                    metrics[-1].val_loss = val_loss
                self._emit(metrics)
                if val_loss is not None:
                    self._call("on_validation_end", done, val_loss)
                self.checkpoints.after_step(self, done, last=last)
                if preempted and not last:
                    raise Preempted(done, self._preemption_save(done))
                interval_start = time.perf_counter()
            self.checkpoints.close()
        except TrainingDiverged as exc:
            self.optimizer.zero_grad(set_to_none=True)
            self.checkpoints.on_divergence(self, done)
            self._call_on_exception(exc)
            raise
        except BaseException as exc:
            self.checkpoints.finish_queued()  # a queued async save is completed, not abandoned
            self._call_on_exception(exc)
            raise
        finally:
            self.preemption.uninstall()
        wall = time.perf_counter() - start
        summary = self._summary(wall)
        self._call("on_fit_end", summary)
        return summary

    def _preemption_save(self, step: int) -> str | None:
        """Save ``step`` after a preemption signal (tagged ``preempted``, unless just saved); returns its name."""
        name = None
        if self.checkpoints.last_saved_step != step:
            self.checkpoints.save(self, step, tag=PREEMPTED)
        self.checkpoints.close()  # committed (an async one included) before the exit
        info = self.checkpoints.manager.wait()
        if info is not None and info.step == step:
            name = info.path.name
        log.warning("preempted after step %d; checkpoint %s committed", step, name)
        return name

    def _summary(self, wall: float) -> Summary:
        vals = [v for _, v in self.val_history] or [math.nan]
        tail = [m.loss for m in self.metrics[-10:]] or [math.nan]
        return Summary(
            experiment=self.experiment,
            run_dir=str(self.run_dir),
            world_size=self.info.world_size,
            strategy=f"{self.cfg.trainer.strategy.name} ({self.cfg.trainer.strategy.sharding_strategy})",
            precision=self.precision,
            model_parameters=self.model_parameters,
            steps=len(self.metrics),
            tokens=len(self.metrics) * self.tokens_per_step,
            wall_time_s=wall,
            median_tokens_per_s=statistics.median([m.tokens_per_s for m in self.metrics] or [0.0]),
            initial_val_loss=vals[0],
            final_val_loss=vals[-1],
            best_val_loss=min(vals),
            final_train_loss=sum(tail) / len(tail),
            peak_mem_mib=max([m.peak_mem_mib for m in self.metrics] or [_peak_mem_mib(self.device)]),
            corpus=self.corpus.describe(),
            corpus_sha256=self.corpus.fingerprint,
        )
