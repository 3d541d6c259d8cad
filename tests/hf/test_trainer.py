"""``shardline.hf.ShardlineTrainer`` / ``sharded(SFTTrainer)`` against Trainer's own DDP, under torchrun and accelerate.

Three launches share the work (tests/hf/trainer_script.py says what each runs): torchrun with 2
CPU ranks, ``accelerate launch`` with the shipped 2-process config, and one plain process that
resumes the torchrun run's checkpoint at world size 1 (and forks the run killed mid-save). The checks:

* parity: final weights within the fp32 trajectory bound of ``tests/numerics.py``
  (assert_close's fp32 defaults, i.e. <= 1e-5 absolute at these magnitudes) against Trainer's
  DDP on the same data -- FULL_SHARD with ``max_grad_norm`` and gradient accumulation, ZeRO-2,
  NO_SHARD, and TRL's SFTTrainer with a LoRA ``peft_config``; the logged losses and global grad
  norms likewise;
* accumulation: no gradient collective after the first micro-batch of a window, one per unit
  after the last;
* checkpoints: ``checkpoint-N/shardline`` verifies; a resume is bit-identical at W=2 and loads
  exactly the saved weights at W=1; ``save_model()`` output loads with ``from_pretrained`` /
  ``PeftModel.from_pretrained``; a save killed mid-way is named and passed over, and a resume
  from an earlier checkpoint moves the later one aside, recorded in the ledger.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("accelerate")

from shardline.checkpoint.integrity.manifest import read_manifest
from shardline.distributed import free_port
from tests.numerics import assert_caught, assert_trajectories, assert_trajectory, close_ratio, trajectory_ratio

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "hf" / "trainer_script.py"
CONFIG = ROOT / "examples" / "accelerate_cpu_2proc.yaml"

pytestmark = pytest.mark.compat  # Trainer and TRL checkpoints and resume, on the installed transformers


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]), "OMP_NUM_THREADS": "1"}


def _launch(cmd: list[str], out: Path, timeout: float) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=out, env=_env())
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]


def _weights(out: Path, name: str) -> dict[str, torch.Tensor]:
    return torch.load(out / f"{name}.weights.pt", weights_only=True)


def _log(out: Path, name: str) -> dict:
    return json.loads((out / f"{name}.log.json").read_text())


def _parity(out: Path, mine: str, theirs: str) -> None:
    a, b = _weights(out, mine), _weights(out, theirs)
    assert_trajectory(trajectory_ratio(a, b), f"{mine} vs {theirs}: final weights")
    la, lb = _log(out, mine), _log(out, theirs)
    assert la["world_size"] == lb["world_size"] == 2
    assert len(la["loss"]) == 4, la
    assert_trajectories(la["loss"], lb["loss"], f"{mine} vs {theirs}")
    assert len(la["grad_norm"]) == len(lb["grad_norm"]), (la["grad_norm"], lb["grad_norm"])
    if la["grad_norm"]:  # transformers 4.x logs the norm only when it clips (max_grad_norm > 0)
        assert_trajectories(la["grad_norm"], lb["grad_norm"], f"{mine} vs {theirs} grad norm")
    if lb["eval_loss"] is not None:  # trainer.evaluate() after training, on the same data
        assert_trajectories([la["eval_loss"]], [lb["eval_loss"]], f"{mine} vs {theirs} evaluate()")


@pytest.fixture(scope="module")
def torchrun_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("torchrun")
    port = str(free_port())
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", port, str(SCRIPT), "torchrun", str(out),
    ]  # fmt: skip
    _launch(cmd, out, timeout=110)
    return out


@pytest.mark.slow
@pytest.mark.numerics
def test_torchrun_full_shard_and_zero2_match_ddp_and_resume_bit_identically(torchrun_run: Path) -> None:
    from transformers import AutoModelForCausalLM

    import shardline.checkpoint as ckpt

    out = torchrun_run
    _parity(out, "full_ga", "ddp_ga")
    _parity(out, "zero2", "ddp")
    # Each comparison sees a bug: no gradient reduction moves the weights, a sum for the mean the grad norms.
    ddp = _weights(out, "ddp")
    assert_caught(trajectory_ratio(_weights(out, "zero2_missing_reduction"), ddp), None, "missing reduction")
    norms = zip(_log(out, "zero2_sum_not_mean")["grad_norm"], _log(out, "ddp")["grad_norm"], strict=True)
    assert_caught({f"step {i}": close_ratio(a, b) for i, (a, b) in enumerate(norms)}, None, "sum, not mean")
    # max_grad_norm=0.05 clipped every step: the logged (pre-clip) global norms are far above it.
    assert min(_log(out, "full_ga")["grad_norm"]) > 0.5
    # Gradient accumulation: nothing reduced after the first micro-batch, one reduction per unit after the second.
    log = _log(out, "full_ga")
    assert log["units"] == 3  # two decoder layers and the root
    assert log["windows"] == [[0, 3]] * 4, log["windows"]
    # Periodic saves: shardline checkpoints inside Trainer's checkpoint-N, chained, verified.
    for step in (2, 4):
        folder = out / "full_ga" / f"checkpoint-{step}"
        assert (folder / "trainer_state.json").is_file()
        report = ckpt.verify_checkpoint(folder / "shardline")
        assert report.ok, report
    manifest2, hash2 = read_manifest(out / "full_ga" / "checkpoint-2" / "shardline")
    manifest4, _ = read_manifest(out / "full_ga" / "checkpoint-4" / "shardline")
    assert (manifest2["step"], manifest2["world_size"], manifest4["step"]) == (2, 2, 4)
    assert manifest4["parent_manifest_sha256"] == hash2
    report = ckpt.Ledger(out / "full_ga" / "lineage.sqlite").verify()
    assert report.ok, report.problems
    assert next((r.checkpoint, r.manifest_sha256) for r in report.rows) == ("checkpoint-2/shardline", hash2)
    # Resumed from checkpoint-2 in a new trainer: the same weights at step 4, bit for bit.
    resumed, full = _weights(out, "full_ga_resumed"), _weights(out, "full_ga")
    assert resumed.keys() == full.keys()
    assert all(torch.equal(resumed[k], full[k]) for k in full)
    # save_model(): a folder from_pretrained loads, with the trained weights.
    loaded = AutoModelForCausalLM.from_pretrained(out / "full_ga_export").state_dict()
    assert all(torch.equal(loaded[k], full[k]) for k in full)


@pytest.fixture(scope="module")
def single_run(torchrun_run: Path) -> Path:
    """The ``single`` phase (one process) in the torchrun run's folder: it resumes that run's checkpoint-2."""
    _launch([sys.executable, str(SCRIPT), "single", str(torchrun_run)], torchrun_run, timeout=100)
    return torchrun_run


@pytest.mark.slow
def test_resume_at_world_size_1(single_run: Path) -> None:
    """The W=2 checkpoint-2 resumed by one process: exactly the saved weights, then training goes on to step 4."""
    from safetensors.torch import load_file

    import shardline.checkpoint as ckpt

    out = single_run
    export = out / "checkpoint-2-export"
    ckpt.consolidate(out / "full_ga" / "checkpoint-2" / "shardline", export)
    saved, loaded = load_file(export / "model.safetensors"), _weights(out, "single_loaded")
    assert saved.keys() == loaded.keys()
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)
    log = _log(out, "single")
    assert (log["world_size"], log["step"]) == (1, 4)
    assert ckpt.verify_checkpoint(out / "single" / "checkpoint-4" / "shardline").ok
    # Trainer's save_total_limit=1 deleted checkpoint-1: the ledger has its tombstone and still verifies.
    assert sorted(p.name for p in (out / "rotate").glob("checkpoint-*")) == ["checkpoint-2"]
    ledger = ckpt.Ledger(out / "rotate" / "lineage.sqlite")
    rows = [(r.event, r.checkpoint, r.step) for r in ledger.rows()]
    assert rows == [
        ("commit", "checkpoint-1/shardline", 1),
        ("commit", "checkpoint-2/shardline", 2),
        ("tombstone", "checkpoint-1/shardline", 1),
    ], rows
    report = ledger.verify()
    assert report.ok, report.problems
    error = (out / "plain_error.txt").read_text()
    assert error.startswith("CheckpointNotFoundError: "), error
    assert "holds no shardline checkpoint (shardline/manifest.json is missing)" in error
    error = (out / "twice_error.txt").read_text()
    assert error.startswith("ConfigurationError: the LlamaForCausalLM given to ShardlineTrainer is already sharded")


@pytest.mark.slow
def test_killed_save_and_roll_back(single_run: Path) -> None:
    """A save killed mid-way is passed over by name; resuming an earlier checkpoint moves the later one aside,
    recorded, where Trainer would overwrite it (tests/hf/trainer_script.py, ``resume_after_a_kill``)."""
    import shardline.checkpoint as ckpt

    out = single_run
    said = json.loads((out / "killed.json").read_text())
    run = out / "killed"
    # The kill, after checkpoint-4's shards were written and before its manifest: its temporary directory stays.
    (tmp,) = [n for n in said["incomplete"] if not n.endswith(".lock")]
    assert tmp.startswith(".shardline.tmp-"), said["incomplete"]
    what = (
        f"an incomplete save ({tmp}, the temporary directory of a save that did not finish; "
        "no shardline/manifest.json and no trainer_state.json)"
    )
    # Its path given explicitly: refused, naming what is missing and the newest complete checkpoint.
    assert said["explicit_error"] == (
        f"CheckpointNotFoundError: cannot resume from {run / 'checkpoint-4'}: it is {what}. Its save was interrupted "
        "(the process was killed or failed while writing it), so there is nothing to load; the newest complete "
        f"checkpoint is {run / 'checkpoint-2'} (resume_from_checkpoint=True picks it)."
    ), said["explicit_error"]
    # No resume at all over committed checkpoints: refused before training, with the ways on.
    assert said["fresh_error"].startswith(
        f"CheckpointExistsError: {run} already holds checkpoint-2 from an earlier run"
    )
    assert "train(resume_from_checkpoint=True) (from checkpoint-2)" in said["fresh_error"]
    assert said["untouched"] == ["checkpoint-2", "checkpoint-4", "lineage.sqlite", "lineage.sqlite.head"]
    # resume_from_checkpoint=True: checkpoint-4 passed over by name, checkpoint-2 resumed, step 4 reached.
    assert "auto_error" not in said, said["auto_error"]
    assert said["auto_step"] == 4
    first, second = sorted((run / "abandoned").iterdir())
    assert said["auto_warnings"] == [
        f"resume_from_checkpoint=True: skipping checkpoint-4, {what}; resuming from checkpoint-2",
        f"moved checkpoint-4 aside to abandoned/{first.name}: {what}",
    ], said["auto_warnings"]
    assert tmp in {p.name for p in first.iterdir()}
    # Then back to checkpoint-2 over the finished checkpoint-4: moved aside whole, recorded, still verifying.
    assert "rollback_error" not in said, said["rollback_error"]
    assert said["rollback_step"] == 4
    reason = "abandoned: training went back to checkpoint-2 (step 2)"
    assert said["rollback_warnings"] == [f"moved checkpoint-4 aside to abandoned/{second.name}: {reason}"]
    assert (second / "trainer_state.json").is_file()
    assert ckpt.verify_checkpoint(second / "shardline").ok
    assert ckpt.verify_checkpoint(run / "checkpoint-4" / "shardline").ok
    _, hash2 = read_manifest(run / "checkpoint-2" / "shardline")
    _, abandoned = read_manifest(second / "shardline")
    manifest4, hash4 = read_manifest(run / "checkpoint-4" / "shardline")
    assert manifest4["parent_manifest_sha256"] == hash2
    ledger = ckpt.Ledger(run / "lineage.sqlite")
    rows = [(r.event, r.checkpoint, r.step, r.manifest_sha256) for r in ledger.rows()]
    assert rows == [
        ("commit", "checkpoint-2/shardline", 2, hash2),
        ("commit", "checkpoint-4/shardline", 4, abandoned),
        ("tombstone", "checkpoint-4/shardline", 4, abandoned),
        ("commit", "checkpoint-4/shardline", 4, hash4),
    ], rows
    detail = json.loads(ledger.rows()[2].detail)
    moved_to = f"abandoned/{second.name}/shardline"
    assert detail == {"checkpoint": "checkpoint-4/shardline", "commit_row": 2, "moved_to": moved_to,
                      "reason": f"{reason}; moved aside to {moved_to}"}  # fmt: skip
    report = ckpt.audit(ledger)
    assert report.ok, report.problems


@pytest.mark.slow
@pytest.mark.numerics
def test_accelerate_launch_no_shard_and_trl_lora_match_ddp(tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import LlamaConfig, LlamaForCausalLM

    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIG),
        "--main_process_port", str(free_port()), str(SCRIPT), "accelerate", str(tmp_path),
    ]  # fmt: skip
    _launch(cmd, tmp_path, timeout=110)
    _parity(tmp_path, "no_shard", "ddp")
    _parity(tmp_path, "lora_full", "lora_ddp")
    # bf16=True: parameters gathered and computed in bf16, fp32 shards and reduction; the losses, grad norms
    # and eval loss stay within assert_close's bf16 tolerance of the fp32 DDP run.
    mp = json.loads((tmp_path / "bf16.dtypes.json").read_text())
    assert mp == ["torch.bfloat16", "torch.float32", ["torch.float32"]]
    bf16, fp32 = _log(tmp_path, "bf16"), _log(tmp_path, "ddp")
    pairs = {
        f"{key} {i}": (a, b)
        for key in ("loss", "grad_norm")
        for i, (a, b) in enumerate(zip(bf16[key], fp32[key], strict=True))
    }
    pairs["eval_loss"] = (bf16["eval_loss"], fp32["eval_loss"])
    assert_trajectory({k: close_ratio(a, b, torch.bfloat16) for k, (a, b) in pairs.items()}, "bf16 vs fp32 DDP")
    trained = _weights(tmp_path, "lora_full")
    adapters = {k for k in trained if "lora_" in k}
    assert len(adapters) == 8
    # save_model() of the PEFT model: the adapter folder PeftModel.from_pretrained loads.
    torch.manual_seed(0)
    base = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
        )
    )  # fmt: skip
    model = PeftModel.from_pretrained(base, tmp_path / "lora_export")
    state = model.state_dict()
    assert all(torch.equal(state[k], trained[k]) for k in adapters)
