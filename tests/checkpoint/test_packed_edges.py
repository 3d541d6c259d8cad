"""Edges of the packed layout: a save with nothing to pack, and what plain ``dcp.load`` says about a packed checkpoint."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

import shardline
import shardline.checkpoint as ckpt
from shardline.checkpoint.format.packed_layout import holds_packable, is_segment_key, layout_of

DOCS = Path(__file__).parents[2] / "docs" / "checkpoint-protocol.md"


def _trained(*, sharded: bool = False) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A small model after one Adam step; ``sharded``: under shardline's engine (a process group must exist)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    if sharded:
        shardline.wrap(model, shardline.layer_policy(torch.nn.Linear), strategy="full_shard")
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return model, opt


def test_a_packed_save_with_nothing_to_pack_is_stored_and_recorded_per_tensor(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A model the engine does not shard holds no DTensor: ``layout="packed"`` (a save, a manager) stores it per
    tensor -- no table in .metadata, plain DCP reads it -- the manifest says ``per_tensor``, and a log line says
    why."""
    model, opt = _trained()
    assert not holds_packable({"model": model.state_dict(), "optim": opt.state_dict(), "trainer": [b"x"]})
    manager = ckpt.CheckpointManager(tmp_path / "managed", layout="packed")
    with caplog.at_level(logging.WARNING, logger="shardline"):
        ckpt.save(tmp_path / "saved", model=model, optimizer=opt, step=1, layout="packed")
        manager.save(ckpt.SaveRequest(model=model, optimizer=opt, step=1))
    for path in (tmp_path / "saved", tmp_path / "managed" / "step-1"):
        metadata = FileSystemReader(str(path)).read_metadata()
        assert layout_of(metadata) is None, f"{path}: an (empty) packed table was recorded"
        assert not [k for k in metadata.state_dict_metadata if is_segment_key(k)]
        manifest = json.loads((path / "manifest.json").read_text())
        assert manifest["sharding"]["layout"] == "per_tensor", manifest["sharding"]
        assert "segment_bytes" not in manifest["sharding"]
        state = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
        dcp.load(state, storage_reader=FileSystemReader(str(path)), no_dist=True)
        for key, value in model.state_dict().items():
            assert torch.equal(state["model"][key], value), key
        assert ckpt.verify_checkpoint(path).ok
    lines = [r.getMessage() for r in caplog.records if "layout='packed' was asked for" in r.getMessage()]
    assert len(lines) == 2, caplog.text
    assert "holds no DTensor the packed layout stores" in lines[0], lines[0]
    assert "its manifest records layout 'per_tensor'" in lines[0], lines[0]


@pytest.fixture
def one_rank() -> Iterator[None]:
    """A one-rank process group in this process (a packed save needs DTensors), destroyed afterwards."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_plain_dcp_load_of_a_packed_checkpoint_fails_as_the_protocol_page_says(one_rank: None, tmp_path: Path) -> None:
    """torch's own planner over torch's own reader never runs shardline code: it fails on the first packed key,
    with the message docs/checkpoint-protocol.md quotes in "What does not read it"."""
    model, opt = _trained(sharded=True)
    ckpt.save(tmp_path / "packed", model=model, optimizer=opt, step=1, layout="packed")
    metadata = FileSystemReader(str(tmp_path / "packed")).read_metadata()
    layout = layout_of(metadata)
    assert layout is not None
    assert layout.entries
    state = {"model": model.state_dict()}
    assert isinstance(next(iter(state["model"].values())), DTensor)
    with pytest.raises(CheckpointException) as failure:
        dcp.load(state, storage_reader=FileSystemReader(str(tmp_path / "packed")))
    text = str(failure.value)
    paragraph = DOCS.read_text().split("**What does not read it.**", 1)[1].split("\n\n", 1)[0]
    quoted = re.findall(r"`(RuntimeError: [^`]*)`", paragraph)
    assert quoted, f"the paragraph quotes no error message: {paragraph}"
    expected = quoted[0].replace("<key>", "model.0.weight")
    assert expected in text, f"documented {expected!r}, dcp.load says: {text}"
