"""The packed layout's save side: segments instead of per-tensor chunks, the table in .metadata, the plan check."""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorProperties
from torch.distributed.checkpoint.metadata import TensorStorageMetadata as Stored
from torch.distributed.checkpoint.planner import SavePlan

import shardline.checkpoint as ckpt
from shardline.checkpoint.format.packed_layout import (
    PACKED_LAYOUT_KEY,
    CheckpointLayout,
    MeshSpec,
    PackedEntry,
    PackedLayout,
    is_segment_key,
    layout_of,
    segment_key,
)
from shardline.checkpoint.integrity.packed_plan import (
    PLAN_DIGEST_KEY,
    PackedSave,
    check_packed_plan,
    segment_write_item,
    table_digest,
)
from shardline.checkpoint.integrity.packed_spread import largest_share, spread_segment_bytes
from shardline.checkpoint.integrity.plan_validation import ShardlineSavePlanner
from shardline.errors import ConfigurationError
from shardline.testing import run_distributed
from tests.checkpoint import packed_ranks
from tests.checkpoint.ranks import unpack

pytestmark = pytest.mark.compat  # the packed layout rests on DTensor and DCP planner APIs: every torch in the matrix

WORLD = 2


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("packed")
    return root, run_distributed(packed_ranks.packed_saves, WORLD, args=(str(root),), timeout=150)


def _metadata(path: Path) -> Metadata:
    return FileSystemReader(str(path)).read_metadata()


def _segments(path: Path) -> dict[str, torch.Tensor]:
    """Every segment of ``path``, read with plain ``dcp.load`` into plain tensors."""
    metadata = _metadata(path)
    state = {
        key: torch.empty(tuple(value.size), dtype=value.properties.dtype)
        for key, value in metadata.state_dict_metadata.items()
        if is_segment_key(key) and isinstance(value, Stored)
    }
    dcp.load(state, storage_reader=FileSystemReader(str(path)), no_dist=True)
    return state


def _expected(pieces: list[tuple[str, str, bytes]], keys: set[str] | None = None) -> dict[str, torch.Tensor]:
    """A rank's pieces of every dtype concatenated in key order (one segment per dtype)."""
    out: dict[str, list[torch.Tensor]] = {}
    for key, dtype, data in pieces:
        if keys is None or key in keys:
            out.setdefault(dtype, []).append(unpack(data))
    return {dtype: torch.cat(parts) for dtype, parts in out.items()}


def test_a_full_shard_save_writes_one_segment_per_rank_and_dtype_and_the_table(
    saved: tuple[Path, list[dict[str, Any]]],
) -> None:
    root, facts = saved
    metadata = _metadata(root / "packed")
    stored = metadata.state_dict_metadata
    segment_keys = sorted(k for k in stored if is_segment_key(k))
    packed = [key for key, _, _ in facts[0]["locals"]]
    assert len(packed) > 40
    # W x dtypes items for the DTensors (all float32 here), not one item per tensor
    assert segment_keys == sorted(segment_key(r, "float32", 0) for r in range(WORLD))
    assert not set(packed) & set(stored), "a packed tensor was also stored per tensor"
    assert {"model.pos_scale", "optim.state.emb.weight.step"} <= set(stored)  # plain tensors stay DCP items
    layout = layout_of(metadata)
    assert layout is not None
    assert [e.key for e in layout.entries] == packed
    assert layout.world_size == WORLD
    assert all(len(stored[k].chunks) == 1 for k in segment_keys)
    segments = _segments(root / "packed")
    for rank, f in enumerate(facts):
        assert [k for k, _, _ in f["locals"]] == packed
        expected = _expected(f["locals"])
        assert torch.equal(segments[segment_key(rank, "float32", 0)], expected["float32"]), rank
    manifest = json.loads((root / "packed" / "manifest.json").read_text())
    assert manifest["sharding"]["layout"] == "packed"
    assert manifest["sharding"]["segment_bytes"] == 256 * 2**20
    assert ckpt.verify_checkpoint(root / "packed").ok


def test_small_segments_are_cut_by_the_rule_and_hold_the_same_bytes(saved: tuple[Path, list[dict[str, Any]]]) -> None:
    root, facts = saved
    metadata = _metadata(root / "small")
    layout = layout_of(metadata)
    assert layout is not None
    assert layout.segment_bytes == 64
    planned = {k: tuple(v.size) for k, v in metadata.state_dict_metadata.items() if is_segment_key(k)}
    expected = layout.expected_segment_sizes()
    assert planned == {k: (n,) for k, n in expected.items()}
    assert len(planned) > 4 * WORLD
    segments = _segments(root / "small")
    for rank, f in enumerate(facts):
        parts = [segments[s.key] for s in layout.segments(rank)]
        assert torch.equal(torch.cat(parts), _expected(f["locals"])["float32"]), rank


def test_a_packed_rank_cuts_its_segments_to_spread_them_over_its_files(
    saved: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    root, facts = saved
    path = root / "spread"  # files_per_rank=2: each rank writes two files, as a per-tensor save would
    metadata = _metadata(path)
    layout = layout_of(metadata)
    assert layout is not None
    largest = max(sum(unpack(data).nbytes for _, _, data in f["locals"]) for f in facts)
    assert layout.segment_bytes == -(-largest // 2) < 256 * 2**20  # the size used, recorded in the table
    assert sorted(p.name for p in path.glob("*.distcp")) == [f"__{r}_{n}.distcp" for r in range(WORLD) for n in (0, 1)]
    stored_in = {index.fqn: info.relative_path for index, info in metadata.storage_data.items()}
    segments = _segments(path)
    for rank, f in enumerate(facts):
        keys = [s.key for s in layout.segments(rank)]
        assert len(keys) >= 2, rank
        assert {stored_in[k] for k in keys} == {f"__{rank}_0.distcp", f"__{rank}_1.distcp"}, rank
        parts = [segments[k] for k in keys]
        assert torch.equal(torch.cat(parts), _expected(f["locals"])["float32"]), rank
    assert json.loads((path / "manifest.json").read_text())["sharding"]["segment_bytes"] == 256 * 2**20
    assert ckpt.verify_checkpoint(path).ok
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ckpt.consolidate(path, tmp_path / "spread.safetensors", verify="none")
        ckpt.consolidate(root / "packed", tmp_path / "packed.safetensors", verify="none")
    spread, packed = load_file(tmp_path / "spread.safetensors"), load_file(tmp_path / "packed.safetensors")
    assert spread.keys() == packed.keys()
    assert len(spread) > 10
    for key, value in packed.items():  # the same weights, bit for bit, as the one-file packed save of the model
        assert spread[key].dtype == value.dtype
        assert torch.equal(spread[key].view(torch.uint8), value.view(torch.uint8)), key


def test_the_segment_size_spreads_the_largest_rank_over_its_files() -> None:
    entries = (
        PackedEntry("a", "float32", (64, 256 * 2**10), 0, 0),  # 32 MiB per rank of 2
        PackedEntry("b", "bfloat16", (2, 3 * 2**20), 0, None),  # 12 MiB, written by rank 0 only
    )
    layout = PackedLayout(2, 256 * 2**20, (MeshSpec((2,), (0, 1)),), entries)
    assert largest_share(layout) == 44 * 2**20  # rank 0: its rows of "a" and all of "b"
    assert spread_segment_bytes(layout, files_per_rank=1) == 256 * 2**20  # one file: the configured size
    assert spread_segment_bytes(layout, files_per_rank=4) == 11 * 2**20  # ceil(44 MiB / 4)
    assert spread_segment_bytes(layout, files_per_rank=0) == 256 * 2**20  # automatic: >= 64 MiB per file, so one
    larger = dataclasses.replace(layout, entries=(PackedEntry("a", "float32", (64, 5 * 2**18), 0, 0),))  # 160 MiB
    assert spread_segment_bytes(larger, files_per_rank=0) == 80 * 2**20  # automatic: two files of 80 MiB
    smaller = dataclasses.replace(layout, segment_bytes=2**20)
    assert spread_segment_bytes(smaller, files_per_rank=4) == 2**20  # never above the configured size
    with pytest.raises(ConfigurationError, match="files_per_rank"):
        spread_segment_bytes(layout, files_per_rank=-1)
    with pytest.raises(ConfigurationError, match="files_per_rank"):
        ShardlineSavePlanner(layout="packed", files_per_rank=-1)


def test_a_replicated_model_writes_its_pieces_once(saved: tuple[Path, list[dict[str, Any]]]) -> None:
    root, facts = saved
    metadata = _metadata(root / "replicated")
    segment_keys = sorted(k for k in metadata.state_dict_metadata if is_segment_key(k))
    assert segment_keys == [segment_key(0, "float32", 0)]  # rank 1 holds replicas only: no segment
    layout = layout_of(metadata)
    assert layout is not None
    assert all(e.shard_dim is None for e in layout.entries)
    segments = _segments(root / "replicated")
    expected = _expected(facts[0]["replicated_locals"])["float32"]
    assert torch.equal(segments[segment_keys[0]], expected)
    assert torch.equal(expected, _expected(facts[1]["replicated_locals"])["float32"])  # the replicas agree


def test_async_packed_gives_the_sync_bytes_and_a_torn_piece_fails_the_save(
    saved: tuple[Path, list[dict[str, Any]]],
) -> None:
    root, facts = saved
    assert all(f["async_info"] for f in facts)
    sync, background = _segments(root / "packed"), _segments(root / "async" / "step-1")
    assert sync.keys() == background.keys()
    assert all(torch.equal(sync[k], background[k]) for k in sync)
    for f in facts:
        kind, message = f["torn"]
        assert kind == "CheckpointError", f["torn"]
        assert "IntegrityError: rank " in message, message
        assert "differ from what it staged" in message, message
        assert "segment _shardline_packed.r" in message, message
        assert "are not the bytes staged" in message, message
    assert not (root / "async" / "step-2").exists()


@pytest.mark.parametrize(
    ("what", "phrase"),
    [("digest", "built a layout table that differs from rank 0's"), ("size", "segment(s) of the wrong size")],
)
def test_an_altered_rank_fails_the_plan_check_on_every_rank(
    saved: tuple[Path, list[dict[str, Any]]], what: str, phrase: str
) -> None:
    root, facts = saved
    for f in facts:
        kind, message = f[f"altered_{what}"]
        assert kind == "CheckpointError", f[f"altered_{what}"]
        assert "Failed to validate global plan" in message, message
        assert phrase in message, message
    assert not (root / f"altered-{what}").exists()
    assert not [p for p in root.iterdir() if p.name.startswith(f".altered-{what}")]


def test_local_rows_other_than_the_rules_fail_the_save_on_every_rank(saved: tuple[Path, list[dict[str, Any]]]) -> None:
    _, facts = saved
    message = facts[0]["uneven_rows"]
    assert "packed layout: rank 0 holds rows (0, 3) of 'w'" in message, message
    assert "gives it rows (0, 2)" in message, message
    assert facts[1]["uneven_rows"] == message  # rank 1's rows are right; it fails with rank 0's error


def test_a_full_save_refuses_the_packed_layout(saved: tuple[Path, list[dict[str, Any]]]) -> None:
    _, facts = saved
    for f in facts:
        kind, message = f["full_refused"]
        assert kind == "ConfigurationError", f["full_refused"]
        assert "nothing to pack" in message, message


# -- the plan check alone (no ranks) ------------------------------------------------------------------------------


def _layout() -> PackedLayout:
    entries = (PackedEntry("w", "float32", (5, 3), 0, 0), PackedEntry("b", "bfloat16", (4,), 0, None))
    return PackedLayout(2, 2**20, (MeshSpec((2,), (0, 1)),), entries)


def _plans(layout: PackedLayout) -> list[SavePlan]:
    digest = table_digest(layout)
    plans = []
    for rank in range(layout.world_size):
        items = [segment_write_item(s.key, s.numel, s.dtype) for s in layout.segments(rank)]
        plans.append(SavePlan(items, planner_data={PLAN_DIGEST_KEY: digest}))
    return plans


def _coordinator(layout: PackedLayout) -> ShardlineSavePlanner:
    """Rank 0's planner after its local plan (its packed part holds the table)."""
    planner = ShardlineSavePlanner(layout="packed")
    planner.packed = PackedSave(layout, 0, {}, {s.key: s for s in layout.segments(0)})
    return planner


def test_the_plan_check_accepts_the_tables_segments_and_records_the_table() -> None:
    layout = _layout()
    _, metadata = _coordinator(layout).create_global_plan(_plans(layout))
    assert metadata.planner_data[PACKED_LAYOUT_KEY] == layout.to_data()
    assert PLAN_DIGEST_KEY not in metadata.planner_data
    assert sorted(k for k in metadata.state_dict_metadata) == sorted(layout.expected_segment_sizes())


def test_the_plan_check_names_missing_unexpected_and_resized_segments() -> None:
    layout = _layout()
    plans = _plans(layout)
    plans[1] = dataclasses.replace(plans[1], items=[])  # rank 1's segment is missing
    plans[0] = dataclasses.replace(
        plans[0],
        items=[
            segment_write_item(segment_key(0, "float32", 0), 10, "float32"),  # 9 expected
            plans[0].items[0],  # the bfloat16 segment, as planned
            segment_write_item(segment_key(0, "float32", 7), 1, "float32"),
        ],
    )
    stored = {
        i.index.fqn: Stored(TensorProperties(), i.tensor_data.size, []) for p in plans for i in p.items if i.tensor_data
    }
    errors = check_packed_plan(layout, plans, Metadata(stored))
    text = "\n".join(errors)
    assert "1 segment(s) the table expects were not planned: '_shardline_packed.r1.float32.s0'" in text, text
    assert "were planned that the table does not give: '_shardline_packed.r0.float32.s7'" in text, text
    assert "'_shardline_packed.r0.float32.s0' planned (10,) expected (9,)" in text, text
    assert len(errors) == 3, errors


def test_the_plan_check_names_a_rank_whose_table_differs() -> None:
    layout = _layout()
    plans = _plans(layout)
    plans[1] = dataclasses.replace(plans[1], planner_data={PLAN_DIGEST_KEY: "f" * 64})
    with pytest.raises(ValueError, match=r"^Failed to validate global plan") as failure:
        _coordinator(layout).create_global_plan(plans)
    message = str(failure.value)
    assert message.startswith("Failed to validate global plan: packed layout: 1 rank(s) (plan 1)"), message


def test_a_per_tensor_rank_zero_refuses_packed_plans_and_bad_options_are_refused() -> None:
    layout = _layout()
    with pytest.raises(ValueError, match="some ranks planned a packed save and rank 0 did not"):
        ShardlineSavePlanner().create_global_plan(_plans(layout))
    with pytest.raises(ConfigurationError, match="unknown checkpoint layout 'dense'"):
        ShardlineSavePlanner(layout="dense")
    with pytest.raises(ConfigurationError, match="segment_bytes must be a positive number of bytes, got 0"):
        ShardlineSavePlanner(layout="packed", segment_bytes=0)


def test_the_layout_options_are_checked_where_a_save_is_configured(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigurationError, match="nothing to pack"):
        ckpt.SaveRequest(model=model, step=1, kind="full", layout="packed")
    with pytest.raises(ConfigurationError, match="segment_bytes must be a positive number of bytes, got -1"):
        ckpt.SaveRequest(model=model, step=1, segment_bytes=-1)
    with pytest.raises(ConfigurationError, match="unknown checkpoint layout 'dense'"):
        ckpt.CheckpointManager(tmp_path / "c", layout="dense")
    manager = ckpt.CheckpointManager(tmp_path / "c", layout="segments", segment_bytes=4096)
    assert (manager.layout, manager.segment_bytes) == (CheckpointLayout.PACKED, 4096)
    manager.close()


def test_the_dcp_native_writer_refuses_a_packed_plan(tmp_path: Path) -> None:
    with pytest.raises(CheckpointException) as failure:  # DCP's collective error, carrying the Writer's
        dcp.save(
            {"w": torch.ones(2)},
            storage_writer=ckpt.Writer(tmp_path / "step-1"),
            planner=ShardlineSavePlanner(layout="packed"),
            no_dist=True,
        )
    assert "ConfigurationError: the DCP-native Writer saves the per_tensor layout" in str(failure.value)
    assert not (tmp_path / "step-1").exists()
