"""What the simulated save's capture hands the commit, for ``benchmarks/scale_sim.py``: the captured checkpoint of a
70B Llama sharded FULL_SHARD over W ranks (its units and model info; no state dict), and each rank's file digests.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from benchmarks.scale_layout import Tensor, fake_sha256, file_bytes, llama_tensors
from shardline.checkpoint.integrity.hashing import FileDigest
from shardline.checkpoint.lifecycle.capture import CapturedCheckpoint
from shardline.checkpoint.storage.stores import locate

__all__ = ["captured_checkpoint", "rank_digests"]


def _units(world: int, layers: int) -> list[dict[str, Any]]:
    """``describe_units`` records of a FULL_SHARD Llama: one unit per decoder layer, then the root."""
    mp = {"param_dtype": "bfloat16", "reduce_dtype": "float32", "output_dtype": None, "buffer_dtype": None,
          "cast_forward_inputs": True}  # fmt: skip
    unit = {"strategy": "full_shard", "shard_size": world, "replicate_size": 1, "master_dtype": "float32",
            "mixed_precision": mp}  # fmt: skip
    params = llama_tensors(layers=layers)
    numel = {name: math.prod(shape) for name, shape in params}
    out = []
    for i in range(layers):
        mine = [n for n in numel if n.startswith(f"model.layers.{i}.")]
        out.append({**unit, "name": f"model.layers.{i}", "params": len(mine), "numel": sum(numel[n] for n in mine)})
    rest = [n for n in numel if not n.startswith("model.layers.")]
    return [*out, {**unit, "name": "", "params": len(rest), "numel": sum(numel[n] for n in rest)}]


def _model_info(tensors: list[Tensor]) -> dict[str, Any]:
    state = {t.key.removeprefix("model."): [list(t.shape), "float32"] for t in tensors if t.key.startswith("model.")}
    return {"parameters": sum(math.prod(s[0]) for s in state.values()), "scalars": [], "state": state,
            "tensors": len(state), "tied": []}  # fmt: skip


def captured_checkpoint(final: Path, world: int, tensors: list[Tensor], layers: int) -> CapturedCheckpoint:
    """What a save's capture hands the commit (the state dict itself is not needed there)."""
    return CapturedCheckpoint(
        final=locate(final),
        step=100_000,
        tag=None,
        kind="sharded",
        world_size=world,
        state_dict={},
        units=_units(world, layers),
        model_info=_model_info(tensors),
        contents={"model": True, "optimizer": True, "trainer_state": True, "config": True, "per_rank_state": True},
        config_sha256=fake_sha256("config"),
        data_fingerprint="simulated",
        parent_manifest_hash=fake_sha256("parent"),
        config={"model": "llama-3-70b", "world_size": world},
    )


def rank_digests(tensors: list[Tensor], world: int, rank: int, files: int) -> list[FileDigest]:
    """The digests rank ``rank`` reports for its ``files`` data files."""
    sizes = file_bytes(tensors, world, rank, files)
    return [
        FileDigest(path=f"__{rank}_{n}.distcp", rank=rank, bytes=size, sha256=fake_sha256(f"{rank}/{n}"))
        for n, size in enumerate(sizes)
    ]
