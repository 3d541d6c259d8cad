"""Rank functions for the Lightning tests: a LightningModule trained by lightning.Trainer with ShardlineStrategy."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from tests.checkpoint.ranks import pack
from tests.lightning.reference import CLIP, LOCAL_BATCH, LR, Block, build_net, dataset, loss_fn


def _quiet() -> None:
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)


def lit_module(seed: int = 0, *, shard_in_configure_model: bool = False) -> Any:
    import lightning.pytorch as pl

    import shardline

    class Regressor(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.save_hyperparameters({"lr": LR, "note": Path("a/path")})  # a Path: stored as text
            self.net = build_net(seed)

        def configure_model(self) -> None:
            if shard_in_configure_model:  # the user shards the blocks; the strategy adds the root unit
                for block in self.net[:2]:
                    shardline.fully_shard(block, mesh=self.device_mesh)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return loss_fn(self.net, *batch)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=LR)

    return Regressor()


def _trainer(root: str, *, epochs: int, callbacks: list[Any], devices: int, strategy: Any = None) -> Any:
    import lightning.pytorch as pl

    from shardline.lightning import ShardlineStrategy

    return pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy or ShardlineStrategy(auto_wrap_policy=[Block]),
        max_epochs=epochs,
        gradient_clip_val=CLIP,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=any(type(c).__name__ == "ModelCheckpoint" for c in callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,  # the loaders bring their own, unshuffled
        default_root_dir=root,
    )


def _loader(batch_size: int, rank: int, world: int) -> torch.utils.data.DataLoader:
    """Rank r takes samples r, r + W, ...: step s of W ranks is step s of one process with a W times larger batch."""
    data = torch.utils.data.TensorDataset(*dataset())
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False)
    return torch.utils.data.DataLoader(data, batch_size=batch_size, sampler=sampler)


def _recorder() -> Any:
    import lightning.pytorch as pl

    class GradNorms(pl.Callback):
        def __init__(self) -> None:
            self.norms: list[float] = []

        def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            self.norms.append(float(trainer.callback_metrics["grad_norm"]))

    return GradNorms()


def _broken(fault: str) -> Any:
    """A callback that runs the whole fit through collectives with a gradient fault (tests.numerics)."""
    import lightning.pytorch as pl

    from shardline.engine import use_collectives
    from shardline.testing import FaultyCollectives

    class Broken(pl.Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.context = use_collectives(trainer.strategy.model, FaultyCollectives(fault))
            self.context.__enter__()

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self.context.__exit__(None, None, None)

    return Broken()


def _weights(trainer: Any) -> bytes:
    import shardline

    full = shardline.full_state_dict(trainer.strategy.model, rank0_only=True)
    return pack({k.removeprefix("module.net."): v for k, v in full.items()})


def train_save_resume(rank: int, world: int, root: str) -> dict[str, Any]:
    """W ranks: train 2 epochs straight (ModelCheckpoint after each epoch), then resume from epoch 1's checkpoint.

    The straight run is sharded by the strategy's wrap policy; the resumed one in configure_model (same units),
    over the data-parallel dimension of a 2-D mesh.
    """
    _quiet()
    from lightning.pytorch.callbacks import ModelCheckpoint

    straight_norms = _recorder()
    saver = ModelCheckpoint(dirpath=f"{root}/ckpts", save_top_k=-1, every_n_epochs=1)
    straight = _trainer(root, epochs=2, callbacks=[straight_norms, saver], devices=world)
    straight.fit(lit_module(), _loader(LOCAL_BATCH, rank, world))
    first = sorted(Path(root, "ckpts").iterdir())[0]
    resumed_norms = _recorder()
    resaver = ModelCheckpoint(dirpath=f"{root}/resumed", save_top_k=-1, every_n_epochs=1)
    # A 2-D mesh as Lightning's ModelParallelStrategy builds it: the strategy shards over its data-parallel dimension.
    from torch.distributed.device_mesh import init_device_mesh

    from shardline.lightning import ShardlineStrategy

    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
    strategy = ShardlineStrategy(auto_wrap_policy=[Block], device_mesh=mesh)
    resumed = _trainer(root, epochs=2, callbacks=[resumed_norms, resaver], devices=world, strategy=strategy)
    resumed.fit(
        lit_module(seed=7, shard_in_configure_model=True), _loader(LOCAL_BATCH, rank, world), ckpt_path=str(first)
    )
    from shardline.testing import GradientFault

    faulted = {}
    for fault in GradientFault:  # the same comparisons must see a broken gradient reduction
        norms = _recorder()
        broken = _trainer(root, epochs=2, callbacks=[norms, _broken(fault.value)], devices=world)
        broken.fit(lit_module(), _loader(LOCAL_BATCH, rank, world))
        faulted[fault.value] = {"weights": _weights(broken), "norms": norms.norms}
    return {
        "unreadable_manifest": _resume_unreadable_manifest(root, first, rank, world),
        "straight": _weights(straight),
        "resumed": _weights(resumed),
        "faulted": faulted,
        "straight_norms": straight_norms.norms,
        "resumed_norms": resumed_norms.norms,
        "resumed_global_step": resumed.global_step,
        "first": str(first),
    }


def _resume_unreadable_manifest(root: str, first: Path, rank: int, world: int) -> str:
    """Resume from a copy of ``first`` whose manifest only rank 0 reads and cannot parse: what each rank raises.

    Every rank must raise rank 0's error; a rank left waiting for rank 0 would hang until the harness's deadline.
    """
    import shutil

    import torch.distributed as dist

    broken = Path(root, "unreadable", first.name)
    if rank == 0:
        shutil.copytree(first, broken)
        (broken / "manifest.json").write_text("{ not json")
    dist.barrier()
    trainer = _trainer(root, epochs=2, callbacks=[], devices=world)
    try:
        trainer.fit(lit_module(), _loader(LOCAL_BATCH, rank, world), ckpt_path=str(broken))
    except Exception as exc:  # the test compares what each rank raised
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def resume_alone(rank: int, world: int, root: str, checkpoint: str) -> dict[str, Any]:
    """One process: resume the W=2 checkpoint with the same global batch, train to the end.

    By the registered name, so with the defaults: the whole model one unit (the checkpoint had three).
    """
    _quiet()
    trainer = _trainer(root, epochs=2, callbacks=[], devices=world, strategy="shardline")
    trainer.fit(lit_module(seed=11), _loader(2 * LOCAL_BATCH, rank, world), ckpt_path=checkpoint)
    return {"weights": _weights(trainer), "global_step": trainer.global_step}
