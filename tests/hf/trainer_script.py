"""Launched by tests/hf/test_trainer.py (torchrun, accelerate launch, or plain python): Trainer runs side by side.

``python trainer_script.py PHASE OUT``. Every phase trains tiny models built from configs on
fixed random tokens and leaves, in ``OUT``, what the test compares: final weights
(``*.weights.pt``, gathered on rank 0), logged losses and grad norms (``*.log.json``), the
collectives of accumulation windows, and the folders ``save_model`` wrote.

* ``torchrun`` (W=2): ShardlineTrainer FULL_SHARD with ``max_grad_norm`` and
  ``gradient_accumulation_steps=2`` and Trainer's DDP on the same data; periodic shardline
  checkpoints; a resume from ``checkpoint-2`` to the same end; ``save_model()``. SHARD_GRAD_OP
  against DDP, and again with a broken gradient reduction (``FaultyCollectives``).
* ``accelerate`` (W=2): NO_SHARD against DDP; TRL ``SFTTrainer(peft_config=LoRA)`` sharded
  against its DDP run; ``save_model()`` of the adapter.
* ``single`` (W=1): resume the torchrun run's ``checkpoint-2`` in one process; record the
  weights it loaded and finish the run; a short run saving every step with ``save_total_limit=1``.
  A run killed while saving ``checkpoint-4`` (a forked child, ended at a crash point), then:
  the incomplete folder refused by path and passed over by ``resume_from_checkpoint=True``; a
  start without resume refused; a resume from ``checkpoint-2`` over the finished
  ``checkpoint-4`` (Trainer's roll-back). What each one said is left in ``killed.json``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

import shardline
from shardline.checkpoint.faults import crashpoints
from shardline.engine import subtree_units, use_collectives
from shardline.hf import ShardlineTrainer, sharded
from shardline.testing import FaultyCollectives

SEQ, SAMPLES, VOCAB = 16, 16, 256


def llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    return LlamaForCausalLM(config)


class Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(2, VOCAB, (SAMPLES, SEQ), generator=g)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class GradComm(TrainerCallback):
    """Gradient collectives after each micro-batch of every accumulation window."""

    def __init__(self) -> None:
        self.windows: list[list[int]] = []

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self._block = shardline.count_collectives(model)
        self._counter = self._block.__enter__()
        self._marks: list[int] = []

    def _mark(self) -> None:
        c = self._counter
        self._marks.append(c.count("reduce_scatter", phase="backward") + c.count("all_reduce", phase="backward"))

    def on_substep_end(self, args, state, control, **kwargs):
        self._mark()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._mark()  # after the last micro-batch's backward and the clipping, before the optimizer

    def on_step_end(self, args, state, control, **kwargs):
        self._block.__exit__(None, None, None)
        self.windows.append(self._marks)


def targs(out: Path, name: str, **kw) -> TrainingArguments:
    base = {
        "output_dir": str(out / name), "per_device_train_batch_size": 2, "learning_rate": 1e-3, "max_steps": 4,
        "logging_steps": 1, "save_strategy": "no", "report_to": [], "use_cpu": True, "seed": 0, "disable_tqdm": True,
        # max_grad_norm never clips here (the factor is clamped to exactly 1), but Trainer logs the global norm:
        # transformers 4.x computes it only when max_grad_norm > 0.
        "dataloader_num_workers": 0, "max_grad_norm": 1e6,
    }  # fmt: skip
    return TrainingArguments(**{**base, **kw})


def rank0() -> bool:
    return dist.get_rank() == 0


def record(out: Path, name: str, trainer: Trainer, weights: dict[str, torch.Tensor], **extra) -> None:
    evaluated = trainer.evaluate(Tokens()) if extra.pop("evaluate", True) else {}
    if rank0():
        log = trainer.state.log_history
        rows = {
            "loss": [r["loss"] for r in log if "loss" in r],
            "grad_norm": [r["grad_norm"] for r in log if "grad_norm" in r],
            "world_size": dist.get_world_size(),
            "eval_loss": evaluated.get("eval_loss"),
            **extra,
        }
        (out / f"{name}.log.json").write_text(json.dumps(rows))
        torch.save({k: v.detach().cpu().clone() for k, v in weights.items()}, out / f"{name}.weights.pt")
    dist.barrier()


def run_ddp(out: Path, name: str, **kw) -> None:
    trainer = Trainer(model=llama(), args=targs(out, name, **kw), train_dataset=Tokens())
    trainer.train()
    assert type(trainer.model_wrapped).__name__ == "DistributedDataParallel", type(trainer.model_wrapped)
    record(out, name, trainer, trainer.model.state_dict())


def run_sharded(
    out: Path, name: str, strategy: str, *, resume: str | None = None, fault: str | None = None, **kw
) -> ShardlineTrainer:
    counts = GradComm()
    trainer = ShardlineTrainer(
        model=llama(), args=targs(out, name, **kw), train_dataset=Tokens(), sharding_strategy=strategy,
        callbacks=[counts],
    )  # fmt: skip
    broken = use_collectives(trainer.model, FaultyCollectives(fault)) if fault else contextlib.nullcontext()
    with broken:
        trainer.train(resume_from_checkpoint=resume)
    assert trainer.model_wrapped is trainer.model, "the sharded model must not be wrapped (DDP)"
    units = [u for u in subtree_units(trainer.model) if u.params]
    weights = shardline.full_state_dict(trainer.model)
    record(out, name, trainer, weights, windows=counts.windows, units=len(units), evaluate=fault is None)
    return trainer


def torchrun_phase(out: Path) -> None:
    acc = {"gradient_accumulation_steps": 2, "max_grad_norm": 0.05, "save_strategy": "steps", "save_steps": 2}
    run_ddp(out, "ddp_ga", **{**acc, "save_strategy": "no"})
    trainer = run_sharded(out, "full_ga", "full_shard", **acc)
    trainer.save_model(str(out / "full_ga_export"))
    # Resume from checkpoint-2 in a new trainer: the same weights at the end, bit for bit.
    run_sharded(out, "full_ga_resumed", "full_shard", resume=str(out / "full_ga" / "checkpoint-2"), **acc)
    run_ddp(out, "ddp")
    run_sharded(out, "zero2", "shard_grad_op")
    # The same comparisons must see a broken gradient reduction (tests/numerics.py, assert_caught).
    for fault in ("missing_reduction", "sum_not_mean"):
        run_sharded(out, f"zero2_{fault}", "shard_grad_op", fault=fault)


def accelerate_phase(out: Path) -> None:
    run_ddp(out, "ddp")
    run_sharded(out, "no_shard", "no_shard")
    trainer = run_sharded(out, "bf16", "full_shard", bf16=True)  # shardline's mixed precision from Trainer's bf16
    if rank0():
        unit = subtree_units(trainer.model)[0]
        mp = unit.mixed_precision
        dtypes = {str(p.dtype) for p in trainer.model.parameters()}
        (out / "bf16.dtypes.json").write_text(json.dumps([str(mp.param_dtype), str(mp.reduce_dtype), sorted(dtypes)]))
    lora(out)


def lora(out: Path) -> None:
    import datasets
    import tokenizers
    from peft import LoraConfig
    from transformers import PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    vocab = {"<pad>": 0, "</s>": 1, **{f"t{i}": i for i in range(2, VOCAB)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>")
    rows = Tokens().ids.tolist()
    data = datasets.Dataset.from_dict({"input_ids": rows})
    peft_config = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"
    )
    results = {}
    for name, cls in (("lora_ddp", SFTTrainer), ("lora_full", sharded(SFTTrainer))):
        config = SFTConfig(
            output_dir=str(out / name), per_device_train_batch_size=2, learning_rate=1e-2, max_steps=4,
            logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
            max_grad_norm=0.0, max_length=None, packing=False, bf16=False,
        )  # fmt: skip
        model = llama()
        trainer = cls(model=model, args=config, train_dataset=data, processing_class=tokenizer, peft_config=peft_config)
        trainer.train()
        weights = shardline.full_state_dict(trainer.model) if name == "lora_full" else trainer.model.state_dict()
        record(out, name, trainer, weights, evaluate=False)
        results[name] = trainer
        if name == "lora_full":
            trainer.save_model(str(out / "lora_export"))


def killed_save(out: Path) -> None:
    """Train to step 4, saving every 2 steps; the process ends while checkpoint-4 is half written."""
    crashpoints.arm("save.shards_written", hit=2)  # the second save: shards written, no manifest yet
    ShardlineTrainer(model=llama(), args=targs(out, "killed", save_strategy="steps", save_steps=2),
                     train_dataset=Tokens()).train()  # fmt: skip


def resume_after_a_kill(out: Path) -> None:
    """What ShardlineTrainer makes of ``killed/``: an incomplete save, then a roll-back to checkpoint-2."""
    said: dict[str, object] = {}
    warnings: list[str] = []

    class Lines(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    logging.getLogger("shardline.hf.resume").addHandler(Lines(level=logging.WARNING))
    args = targs(out, "killed", save_strategy="steps", save_steps=2)
    run = out / "killed"

    def attempt(key: str, resume: str | bool | None) -> ShardlineTrainer:
        trainer = ShardlineTrainer(model=llama(), args=args, train_dataset=Tokens())
        try:
            trainer.train(resume_from_checkpoint=resume)
        except shardline.ShardlineError as e:
            said[key] = f"{type(e).__name__}: {e}"
        return trainer

    said["incomplete"] = sorted(p.name for p in (run / "checkpoint-4").iterdir())
    attempt("explicit_error", str(run / "checkpoint-4"))
    attempt("fresh_error", None)
    said["untouched"] = sorted(p.name for p in run.iterdir())  # both refusals moved nothing
    trainer = attempt("auto_error", True)
    said["auto_step"] = trainer.state.global_step
    said["auto_warnings"] = list(warnings)
    warnings.clear()
    trainer = attempt("rollback_error", str(run / "checkpoint-2"))
    said["rollback_step"] = trainer.state.global_step
    said["rollback_warnings"] = list(warnings)
    (out / "killed.json").write_text(json.dumps(said))


def single_phase(out: Path) -> None:
    # Before any process group: the child is forked from a process that holds none.
    child = multiprocessing.get_context("fork").Process(target=killed_save, args=(out,))
    child.start()
    child.join(90)
    if child.exitcode is None:
        child.kill()
    assert child.exitcode == crashpoints.CRASH_EXIT_CODE, f"the killed save's child exited {child.exitcode}"
    loaded = {}

    class Loaded(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            loaded.update(shardline.full_state_dict(model))

    acc = {"gradient_accumulation_steps": 2, "max_grad_norm": 0.05, "save_strategy": "steps", "save_steps": 2}
    trainer = ShardlineTrainer(
        model=llama(), args=targs(out, "single", **acc), train_dataset=Tokens(), callbacks=[Loaded()]
    )
    trainer.train(resume_from_checkpoint=str(out / "full_ga" / "checkpoint-2"))
    record(out, "single", trainer, shardline.full_state_dict(trainer.model), step=trainer.state.global_step)
    torch.save(loaded, out / "single_loaded.weights.pt")
    # A save every step, Trainer keeping the newest only (save_total_limit=1): it deletes checkpoint-1.
    rotate = targs(out, "rotate", max_steps=2, save_strategy="steps", save_steps=1, save_total_limit=1)
    ShardlineTrainer(model=llama(), args=rotate, train_dataset=Tokens()).train()
    # A checkpoint-N of a plain Trainer (no shardline/ inside) is refused before anything is loaded.
    plain = out / "plain" / "checkpoint-2"
    plain.mkdir(parents=True)
    (plain / "trainer_state.json").write_bytes((out / "full_ga" / "checkpoint-2" / "trainer_state.json").read_bytes())
    try:
        ShardlineTrainer(model=llama(), args=targs(out, "plain"), train_dataset=Tokens()).train(
            resume_from_checkpoint=str(plain)
        )
    except shardline.ShardlineError as e:
        (out / "plain_error.txt").write_text(f"{type(e).__name__}: {e}")
    resume_after_a_kill(out)
    # A model sharded already is refused: the trainer shards it itself.
    model = shardline.fully_shard(llama())
    try:
        ShardlineTrainer(model=model, args=targs(out, "twice"), train_dataset=Tokens())
    except shardline.ShardlineError as e:
        (out / "twice_error.txt").write_text(f"{type(e).__name__}: {e}")


if __name__ == "__main__":
    phase, out = sys.argv[1], Path(sys.argv[2])
    {"torchrun": torchrun_phase, "accelerate": accelerate_phase, "single": single_phase}[phase](out)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    print(f"phase {phase} done on rank {int(os.environ.get('RANK', '0'))}", flush=True)
