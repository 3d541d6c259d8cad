"""Launched by tests/hf/test_lineage_callback.py with torchrun (W=2, CPU, gloo): Trainer's own FSDP2 with and
without ``shardline.hf.LineageCallback``.

``python lineage_script.py PHASE OUT``:

* ``train``: ``plain`` -- ``Trainer(fsdp=...)`` saving sharded checkpoints at steps 2 and 4, no
  callback (the framework's own checkpoints); ``lined`` -- the same run with the callback;
  ``rotated`` -- saves every step with ``save_total_limit=1`` and the callback with run tags, reporting to
  MLflow (a local store, ``OUT/mlflow.db``).
* ``resume`` (a fresh launch): a byte of ``lined/checkpoint-2``'s model shard flipped, then
  ``train(resume_from_checkpoint=...)`` with the callback (what every rank raised goes to
  ``refused.json``); the byte restored, the same resume trains on to step 4 (``resumed``).

Final weights (gathered, rank 0) go to ``OUT/NAME.weights.pt``.

Note: the stand-in for a GPU. Accelerate 1.x turns a multi-process CPU run into
``DistributedType.MULTI_CPU`` and enables FSDP only for GPU-like types (accelerate/state.py), so on CPU
``Trainer(fsdp=...)`` would train as DDP and never write FSDP's checkpoint layout. :func:`fsdp_on_cpu`
records the distributed type as ``MULTI_GPU`` in Accelerate's process state before each Trainer is
built; Accelerate then selects FSDP as on a GPU and its real FSDP2 code prepares, trains, saves and
loads on the CPU device with gloo. This is in the test only; the product changes nothing of Accelerate's.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate.state import PartialState
from accelerate.utils import DistributedType
from torch.distributed.tensor import DTensor
from transformers import Trainer, TrainingArguments

from shardline.errors import ShardlineError
from shardline.hf import LineageCallback
from tests.hf.trainer_script import Tokens, llama

FLIPPED = "pytorch_model_fsdp_0/__0_0.distcp"


def fsdp_on_cpu() -> None:
    """See the module note: Accelerate selects FSDP for this CPU run as it would on GPUs."""
    PartialState()
    PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU


def targs(out: Path, name: str, **kw) -> TrainingArguments:
    base = {
        "output_dir": str(out / name), "per_device_train_batch_size": 2, "learning_rate": 1e-2, "max_steps": 4,
        "logging_steps": 1, "save_strategy": "steps", "save_steps": 2, "report_to": [], "use_cpu": True, "seed": 0,
        "disable_tqdm": True, "dataloader_num_workers": 0, "fsdp": True,
        "fsdp_config": {"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                        "state_dict_type": "SHARDED_STATE_DICT"},
    }  # fmt: skip
    return TrainingArguments(**{**base, **kw})


def trainer(out: Path, name: str, *, lineage: bool, run_tags: dict[str, str] | None = None, **kw) -> Trainer:
    args = targs(out, name, **kw)
    fsdp_on_cpu()
    callbacks = [LineageCallback(run_tags=run_tags)] if lineage else []
    built = Trainer(model=llama(), args=args, train_dataset=Tokens(), callbacks=callbacks)
    assert built.is_fsdp_enabled
    assert built.accelerator.state.distributed_type == DistributedType.FSDP
    return built


def record(out: Path, name: str, done: Trainer) -> None:
    model = done.model
    assert model is not None
    assert any(isinstance(p, DTensor) for p in model.parameters()), "not sharded by FSDP2"
    weights = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in model.state_dict().items()
    }
    if dist.get_rank() == 0:
        torch.save(weights, out / f"{name}.weights.pt")
    dist.barrier()


def train_phase(out: Path) -> None:
    for name, lineage in (("plain", False), ("lined", True)):
        run = trainer(out, name, lineage=lineage)
        run.train()
        record(out, name, run)
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{out}/mlflow.db"
    os.environ["MLFLOW_EXPERIMENT_NAME"] = "rotated"
    os.environ["DISABLE_MLFLOW_INTEGRATION"] = "FALSE"
    if dist.get_rank() == 0:  # Trainer's MLflow integration runs on rank 0 only
        import mlflow

        mlflow.create_experiment("rotated", artifact_location=f"{out}/mlartifacts")
    rotated = {"max_steps": 3, "save_steps": 1, "save_total_limit": 1, "report_to": ["mlflow"]}
    trainer(out, "rotated", lineage=True, run_tags={"ticket": "FSDP-9"}, **rotated).train()


def _flip(path: Path) -> None:
    if dist.get_rank() == 0:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
    dist.barrier()


def resume_phase(out: Path) -> None:
    checkpoint = out / "lined" / "checkpoint-2"
    targs(out, "lined")  # the process group, gloo (Accelerate's PartialState() alone would leave its backend unset)
    _flip(checkpoint / FLIPPED)
    try:
        trainer(out, "lined", lineage=True).train(resume_from_checkpoint=str(checkpoint))
        refused = None
    except ShardlineError as e:
        refused = {"type": type(e).__name__, "message": str(e)}
    for rank, said in enumerate(_gather(refused)):
        (out / f"refused.{rank}.json").write_text(json.dumps(said))
    _flip(checkpoint / FLIPPED)  # restored
    run = trainer(out, "lined", lineage=True)
    run.train(resume_from_checkpoint=str(checkpoint))
    record(out, "resumed", run)


def _gather(obj: object) -> list[object]:
    gathered: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


if __name__ == "__main__":
    phase, out = sys.argv[1], Path(sys.argv[2])
    {"train": train_phase, "resume": resume_phase}[phase](out)
    dist.barrier()
    dist.destroy_process_group()
    print(f"phase {phase} done on rank {int(os.environ.get('RANK', '0'))}", flush=True)
