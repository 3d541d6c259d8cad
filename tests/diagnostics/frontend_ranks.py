"""Rank functions: the diagnostics callbacks of Lightning and HF Trainer, each logging to an MLflow run in a local
store (the test reads it back with MLflow's own client)."""

from __future__ import annotations

import warnings
from typing import Any


def lightning_fit(rank: int, world: int, root: str) -> dict[str, Any]:
    """4 optimizer steps of the Lightning test model under ShardlineStrategy (run tags; a checkpoint every 2 steps),
    with an MLFlowLogger and a TensorBoardLogger."""
    warnings.filterwarnings("ignore")
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import MLFlowLogger, TensorBoardLogger

    from shardline.lightning import DiagnosticsCallback, ShardlineStrategy
    from tests.lightning.ranks import _loader, lit_module
    from tests.lightning.reference import Block

    logger = MLFlowLogger(
        experiment_name="lit",
        tracking_uri=f"sqlite:///{root}/mlflow.db",
        save_dir=None,
        artifact_location=f"{root}/mlartifacts",  # not ./mlruns in the working directory
    )
    callback = DiagnosticsCallback(memory_steps=2)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=ShardlineStrategy(auto_wrap_policy=[Block], run_tags={"ticket": "LIT-3"}),
        max_steps=4,
        callbacks=[callback, ModelCheckpoint(dirpath=f"{root}/ckpt", every_n_train_steps=2, save_top_k=-1)],
        logger=[logger, TensorBoardLogger(save_dir=root, name="tb")],
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        default_root_dir=root,
    )
    trainer.fit(lit_module(), _loader(8, rank, world))
    return {"run_id": logger.run_id, "lines": callback.probe.lines, "text": callback.probe.text()}


def hf_train(rank: int, world: int, root: str) -> dict[str, Any]:
    """4 steps of a tiny Llama under ShardlineTrainer with report_to=["mlflow", "tensorboard"], run tags, and a
    checkpoint every 2 steps."""
    import os

    warnings.filterwarnings("ignore")
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{root}/mlflow.db"
    os.environ["MLFLOW_EXPERIMENT_NAME"] = "hf"
    os.environ["DISABLE_MLFLOW_INTEGRATION"] = "FALSE"
    import mlflow

    mlflow.create_experiment("hf", artifact_location=f"{root}/mlartifacts")  # not ./mlruns in the working directory
    from shardline.hf import DiagnosticsCallback, ShardlineTrainer
    from tests.hf.trainer_script import Tokens, llama, targs

    callback = DiagnosticsCallback(memory_steps=2)
    args = targs(
        __import__("pathlib").Path(root),
        "out",
        report_to=["mlflow", "tensorboard"],
        save_strategy="steps",
        save_steps=2,
    )
    trainer = ShardlineTrainer(
        model=llama(), args=args, train_dataset=Tokens(), callbacks=[callback], run_tags={"ticket": "HF-7"}
    )
    trainer.train()
    run = mlflow.last_active_run()
    return {"run_id": run.info.run_id if run else None, "lines": callback.probe.lines, "text": callback.probe.text()}
