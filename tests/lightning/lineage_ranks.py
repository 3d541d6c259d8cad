"""Rank functions: Lightning's own FSDPStrategy / ModelParallelStrategy, with and without shardline's lineage."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

from tests.checkpoint.ranks import pack
from tests.lightning.ranks import _loader, _quiet
from tests.lightning.reference import LOCAL_BATCH, LR, Block, build_net, loss_fn


class OwnFSDPStrategy(FSDPStrategy):
    """Lightning's FSDPStrategy, unchanged. Lightning refuses ``FSDPStrategy`` itself with ``accelerator="cpu"``
    (an exact type check in its accelerator connector); a subclass that overrides nothing runs its own code on CPU."""


def lit_module(kind: str, seed: int = 0) -> Any:
    """The reference regressor; ``configure_model`` shards it as each strategy expects on CPU.

    FSDP: wrapped in FSDP1 by the module itself with ``device_id=cpu`` (the strategy's own wrapping passes the
    CUDA device index, which FSDP1 refuses without an accelerator; Lightning keeps a model already wrapped).
    ModelParallel: FSDP2 over the mesh's data-parallel dimension, as Lightning's docs show.
    """
    import lightning.pytorch as pl
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    class Regressor(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.save_hyperparameters({"lr": LR})
            self.net = build_net(seed)

        def configure_model(self) -> None:
            if kind == "fsdp":
                policy = ModuleWrapPolicy({Block})
                self.net = FullyShardedDataParallel(
                    self.net, auto_wrap_policy=policy, device_id=torch.device("cpu"), use_orig_params=True
                )
            else:
                mesh = self.device_mesh["data_parallel"]
                for block in self.net[:2]:
                    fully_shard(block, mesh=mesh)
                fully_shard(self.net, mesh=mesh)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return loss_fn(self.net, *batch)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=LR)

    return Regressor()


def strategy(kind: str, *, lineage: bool, run_tags: dict[str, str] | None = None) -> Any:
    from shardline.lightning import LineageFSDPStrategy, LineageModelParallelStrategy

    if kind == "fsdp":
        return LineageFSDPStrategy(run_tags=run_tags) if lineage else OwnFSDPStrategy(state_dict_type="sharded")
    world = dist.get_world_size()
    if lineage:
        return LineageModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1, run_tags=run_tags)
    return ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)


def _fit(
    root: Path,
    kind: str,
    *,
    lineage: bool,
    saves: str | None = None,
    resume: Path | None = None,
    keep: int = -1,
    tracked: bool = False,
) -> Any:
    """Two epochs (4 steps each) at this rank's share of the data. With ``saves``: a checkpoint there after each
    epoch (all kept), or with ``keep=1`` every 2 steps, each pruning the one before. ``tracked``: run tags
    (ticket ``LIN-<kind>``) and an MLFlowLogger (``root/mlflow.db``, experiment ``kind``)."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import MLFlowLogger

    logger: Any = False
    if tracked:
        if dist.get_rank() == 0:  # the store's schema, made once: each rank's logger opens the store
            from mlflow.tracking import MlflowClient

            MlflowClient(tracking_uri=f"sqlite:///{root}/mlflow.db").search_experiments()
        dist.barrier()
        logger = MLFlowLogger(
            experiment_name=kind,
            tracking_uri=f"sqlite:///{root}/mlflow.db",
            save_dir=None,
            artifact_location=f"{root}/mlartifacts",
        )

    every = {"every_n_epochs": 1} if keep == -1 else {"every_n_train_steps": 2}
    callbacks = [ModelCheckpoint(dirpath=root / saves, save_top_k=keep, **every)] if saves else []
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=dist.get_world_size(),
        strategy=strategy(kind, lineage=lineage, run_tags={"ticket": f"LIN-{kind}"} if tracked else None),
        max_epochs=2,
        callbacks=callbacks,
        enable_checkpointing=bool(saves),
        logger=logger,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        default_root_dir=str(root),
    )
    module = lit_module(kind, seed=7 if resume else 0)
    trainer.fit(module, _loader(LOCAL_BATCH, dist.get_rank(), dist.get_world_size()), ckpt_path=resume)
    return trainer


def _weights(module: Any) -> bytes:
    """This rank's shard of every parameter (every run of a kind shards alike, so shards compare run to run)."""
    from torch.distributed.tensor import DTensor

    return pack(
        {
            name: (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in module.named_parameters()
        }
    )


def _fresh(kind: str) -> bytes:
    """The shards of the model a resume starts from (seed 7), sharded as the strategy would, never trained."""
    module = lit_module(kind, seed=7)
    if kind == "model_parallel":
        from torch.distributed.device_mesh import init_device_mesh

        module._device_mesh = init_device_mesh(
            "cpu", (dist.get_world_size(), 1), mesh_dim_names=("data_parallel", "tensor_parallel")
        )
    module.configure_model()
    return _weights(module)


def _damaged(root: Path, first: Path, victim: str) -> Path:
    """A copy of ``first`` with one byte of ``victim`` flipped."""
    damaged = root / "damaged" / first.name
    if dist.get_rank() == 0:
        shutil.copytree(first, damaged)
        with open(damaged / victim, "r+b") as f:
            f.seek(40)
            byte = f.read(1)
            f.seek(40)
            f.write(bytes([byte[0] ^ 0xFF]))
    dist.barrier()
    return damaged


def _attempt(kind: str, checkpoint: Path) -> dict[str, Any]:
    """Resume with lineage from ``checkpoint``, expected to be refused: what this rank raised, and the weights of
    the fresh model afterwards (to compare with its initial ones: nothing may have been loaded)."""
    import lightning.pytorch as pl

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=dist.get_world_size(),
        strategy=strategy(kind, lineage=True),
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
    )
    module = lit_module(kind, seed=7)
    try:
        trainer.fit(module, _loader(LOCAL_BATCH, dist.get_rank(), dist.get_world_size()), ckpt_path=checkpoint)
        error = "no error"
    except Exception as exc:  # the test checks what each rank raised
        error = f"{type(exc).__name__}: {exc}"
    return {"error": error, "weights": _weights(module), "global_step": trainer.global_step}


def train_resume(rank: int, world: int, root: str, kind: str) -> dict[str, Any]:
    """For ``kind`` ("fsdp" or "model_parallel"): the framework's own checkpoint and resume, the same with lineage,
    a lineage checkpoint resumed by the framework's own strategy, and a resume from a damaged copy."""
    _quiet()
    base = Path(root, kind)
    _fit(base, kind, lineage=False, saves="own")
    own = sorted((base / "own").iterdir())
    own_resumed = _fit(base, kind, lineage=False, resume=own[0])
    straight = _fit(base, kind, lineage=True, saves="lineage", tracked=True)
    saved = sorted((base / "lineage").glob("epoch=*"))
    resumed = _fit(base, kind, lineage=True, saves="resumed", resume=saved[0], keep=1)
    by_own = _fit(base, kind, lineage=False, resume=saved[0])  # Lightning's own strategy reads the same layout
    victim = "__1_0.distcp" if kind == "fsdp" else "meta.pt"
    return {
        "own": [str(p) for p in own],
        "saved": [str(p) for p in saved],
        "resumed_saves": [str(p) for p in sorted((base / "resumed").glob("epoch=*"))],  # step 6 pruned by step 8
        "own_resumed": _weights(own_resumed.lightning_module),
        "straight": _weights(straight.lightning_module),
        "resumed": _weights(resumed.lightning_module),
        "by_own": _weights(by_own.lightning_module),
        "resumed_global_step": resumed.global_step,
        "damaged": _attempt(kind, _damaged(base, saved[0], victim)),
        "unadopted": _attempt(kind, own[0])["error"],
        "victim": victim,
        "fresh": _fresh(kind),
    }


def both_kinds(rank: int, world: int, root: str) -> dict[str, dict[str, Any]]:
    """:func:`train_resume` for FSDPStrategy and ModelParallelStrategy, in one launch."""
    return {kind: train_resume(rank, world, root, kind) for kind in KINDS}


KINDS = ("fsdp", "model_parallel")
