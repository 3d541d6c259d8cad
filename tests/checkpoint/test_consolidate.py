"""``consolidate``: safetensors equal to the full state dict, HF layout, sidecar, bounded memory."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load_file

import shardline.checkpoint as ckpt
from shardline import cli
from shardline.checkpoint import consolidate
from shardline.checkpoint.integrity.manifest import read_manifest
from tests.models import ParityModel


def _full(step: Path) -> dict[str, torch.Tensor]:
    model = ParityModel()
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(step), no_dist=True)
    return state["model"]


def _read_all(out: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


@pytest.mark.compat
def test_single_file_equals_full_state_dict(saved_run: Path, tmp_path: Path, capsys) -> None:
    step = saved_run / "step-4"
    out = tmp_path / "export"
    assert cli.main(["consolidate", str(step), str(out)]) == 0
    assert "Tied parameters written once: head.weight = emb.weight" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["SHA256SUMS", "consolidation.json", "model.safetensors"]
    full = _full(step)
    got = _read_all(out)
    assert set(got) == set(full) - {"head.weight"}
    for key, value in got.items():
        assert torch.equal(value, full[key]), key
    with safe_open(out / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
    sidecar = json.loads((out / "consolidation.json").read_text())
    assert sidecar["source"]["manifest_sha256"] == read_manifest(step)[1]
    assert sidecar["source"]["step"] == 4
    for entry in sidecar["files"]:
        assert hashlib.sha256((out / entry["path"]).read_bytes()).hexdigest() == entry["sha256"]
    check = subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=out, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.compat
def test_sharded_bf16_with_index(saved_run: Path, tmp_path: Path) -> None:
    step = saved_run / "step-4"
    result = consolidate(step, tmp_path / "export", max_shard_size="600B", dtype="bf16")
    out = result.out
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 2
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert set(index["weight_map"].values()) == set(shards)
    full = _full(step)
    got = _read_all(out)
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in got.values())
    for key, value in got.items():
        assert value.dtype == torch.bfloat16, key
        assert torch.equal(value, full[key].to(torch.bfloat16)), key
        assert index["weight_map"][key] in shards


PEAK_SCRIPT = textwrap.dedent(
    """
    import gc, sys, warnings
    warnings.simplefilter("ignore")
    from shardline.checkpoint import consolidate

    def status(field):
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024

    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak-RSS counter (VmHWM) to the current RSS
    before = status("VmRSS")
    consolidate(sys.argv[1], sys.argv[2], max_shard_size="16MiB", verify="none")
    print(before, status("VmHWM"))
    """
)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc peak-RSS reset")
def test_consolidate_memory_is_bounded(tmp_path: Path) -> None:
    """128 MiB of weights, 4 MiB tensors, 16 MiB shards: peak growth stays far below the model size."""
    torch.manual_seed(0)
    weights = {f"layer{i}.weight": torch.randn(1024, 1024) for i in range(32)}
    dcp.save({"model": weights}, checkpoint_id=str(tmp_path / "src"), no_dist=True)
    del weights
    os.sync()  # the export should read settled files, not pages still being written back
    proc = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT, str(tmp_path / "src"), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        check=True,
    )
    before, peak = map(int, proc.stdout.split())
    growth = peak - before
    # bound: one 16 MiB read batch + the largest tensor twice + allocator slack; the model is 128 MiB
    assert growth < 56 * 2**20, f"peak RSS grew by {growth / 2**20:.1f} MiB while exporting a 128 MiB model"
    assert len(list((tmp_path / "out").glob("*.safetensors"))) == 8


def test_export_of_a_resumed_run_keeps_the_earlier_export(saved_run: Path, tmp_path: Path) -> None:
    """The Export callback at the end of a resumed run: the earlier export is moved aside, never overwritten."""
    from types import SimpleNamespace

    from shardline.checkpoint.lifecycle.consolidate import SIDECAR
    from shardline.train.export import Export

    def finish(step: int) -> None:
        row = next(r for r in ckpt.Ledger(saved_run / "lineage.sqlite").rows() if r.is_commit and r.step == step)
        last = SimpleNamespace(path=saved_run / f"step-{step}", step=step, manifest_hash=row.manifest_sha256)
        manager = SimpleNamespace(wait=lambda: last)
        trainer = SimpleNamespace(is_rank0=True, run_dir=tmp_path, checkpoints=SimpleNamespace(manager=manager))
        Export().on_fit_end(trainer, None)  # type: ignore[arg-type]

    def source(folder: Path) -> dict:
        return json.loads((folder / SIDECAR).read_text())["source"]

    finish(2)
    first = (tmp_path / "export" / "model" / SIDECAR).read_bytes()
    finish(4)  # the resumed run ends at step 4
    assert source(tmp_path / "export" / "model")["step"] == 4
    assert (tmp_path / "export" / "model-step-2" / SIDECAR).read_bytes() == first
    finish(4)  # the same checkpoint again: kept as it is, nothing moved
    assert sorted(p.name for p in (tmp_path / "export").iterdir()) == ["model", "model-step-2"]
    assert source(tmp_path / "export" / "model")["step"] == 4
