"""Reading the packed layout: the logical view, one read per segment, consolidation, tampered tables."""

from __future__ import annotations

import uuid
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

import shardline.checkpoint as ckpt
from shardline.checkpoint import Reader, consolidate
from shardline.checkpoint.format.load_planner import ShardlineLoadPlanner
from shardline.checkpoint.format.packed_layout import MeshSpec, PackedLayout, is_segment_key
from shardline.checkpoint.format.packed_view import logical_metadata, packed_layout, refuse_logical_reads
from shardline.checkpoint.integrity.opening import open_checkpoint
from shardline.checkpoint.integrity.reading import VerifyingReader
from shardline.checkpoint.lifecycle.summary import summarize
from shardline.errors import CheckpointMismatchError, ConfigurationError, IntegrityError
from shardline.testing import run_distributed
from tests.checkpoint import packed_fixture as fx
from tests.checkpoint import packed_load_ranks
from tests.checkpoint.conftest import S3_BUCKET
from tests.checkpoint.ranks import unpack
from tests.checkpoint.seaweed import S3Server

pytestmark = pytest.mark.compat  # the packed layout rests on DTensor and DCP planner APIs: every torch in the matrix

W2 = (MeshSpec((2,), (0, 1)),)


def _load_whole(
    path: Path, shapes: dict[str, torch.Tensor], *, metadata: Any = None, planner: Any = None
) -> tuple[dict[str, torch.Tensor], fx.CountingReader]:
    """Load whole (plain) tensors shaped like ``shapes`` (filled with a sentinel first) without a process group."""
    targets = {k: torch.full_like(v, 7.0) for k, v in shapes.items()}
    view = metadata if metadata is not None else logical_metadata(fx.read_raw(path))
    reader = fx.CountingReader(path, view)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.load(fx._nested(targets), storage_reader=reader, planner=planner or ShardlineLoadPlanner(), no_dist=True)
    return targets, reader


@pytest.fixture
def packed_w2(tmp_path: Path) -> tuple[Path, PackedLayout, dict[str, torch.Tensor]]:
    tensors = fx.full_tensors()
    layout = fx.layout_for(tensors, W2, shard_dim=0, segment_bytes=96)
    path = tmp_path / "packed"
    fx.write_packed(path, layout, tensors, extra={"trainer": b"state"})
    return path, layout, tensors


def test_the_view_lists_logical_tensors_with_their_shapes_and_keeps_storage(packed_w2) -> None:
    path, _, tensors = packed_w2
    raw = fx.read_raw(path)
    view = logical_metadata(raw)
    assert not [k for k in view.state_dict_metadata if is_segment_key(k)]
    assert set(view.state_dict_metadata) == set(tensors) | {"trainer"}
    for key, t in tensors.items():
        md = view.state_dict_metadata[key]
        assert isinstance(md, TensorStorageMetadata)
        assert (tuple(md.size), md.properties.dtype) == (tuple(t.shape), t.dtype)
        assert [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks] == [((0,) * t.dim(), tuple(t.shape))]
        assert view.planner_data[key] == tuple(key.split(".", 1))
    assert view.storage_data is raw.storage_data
    assert logical_metadata(view) is view
    # a checkpoint in the per-tensor layout passes through unchanged
    fx.write_per_tensor(path.parent / "plain", tensors)
    plain = fx.read_raw(path.parent / "plain")
    assert logical_metadata(plain) is plain
    # every shardline reader gets the view (opening.read_checked_metadata)
    opened = open_checkpoint(path, level="none")
    assert set(opened.metadata.state_dict_metadata) == set(tensors) | {"trainer"}


def test_whole_tensors_read_each_segment_once(packed_w2) -> None:
    path, layout, tensors = packed_w2
    got, reader = _load_whole(path, tensors)
    for key, t in tensors.items():
        assert torch.equal(got[key], t), key
    segments = {s.key for r in range(2) for s in layout.segments(r)}
    assert len(segments) > 2  # the small cap cut several segments per rank
    assert any(len(s.pieces) > 1 for r in range(2) for s in layout.segments(r))  # and some hold several tensors
    assert dict(reader.items) == dict.fromkeys(segments, 1)
    storage = fx.read_raw(path).storage_data
    assert reader.bytes_read == sum(int(info.length) for index, info in storage.items() if is_segment_key(index.fqn))


def test_a_partial_read_reads_only_the_segments_holding_it(packed_w2) -> None:
    path, layout, tensors = packed_w2
    got, reader = _load_whole(path, {"model.w1": tensors["model.w1"]})
    assert torch.equal(got["model.w1"], tensors["model.w1"])
    entry = layout.by_key["model.w1"]
    holding = {layout.locate(entry, r)[0].key for r, _, _ in layout.sources(entry, 0, 8)}
    assert dict(reader.items) == dict.fromkeys(holding, 1)


def test_consolidating_packed_gives_the_per_tensor_safetensors_byte_for_byte(packed_w2, tmp_path: Path) -> None:
    path, _, tensors = packed_w2
    fx.write_per_tensor(tmp_path / "plain", tensors, extra={"trainer": b"state"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        consolidate(path, tmp_path / "a.safetensors", verify="none")
        consolidate(tmp_path / "plain", tmp_path / "b.safetensors", verify="none")
        consolidate(path, tmp_path / "sharded", verify="none", max_shard_size=200)
        consolidate(tmp_path / "plain", tmp_path / "sharded_plain", verify="none", max_shard_size=200)
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()
    a = sorted(p.name for p in (tmp_path / "sharded").glob("*.safetensors"))
    assert len(a) > 1
    assert a == sorted(p.name for p in (tmp_path / "sharded_plain").glob("*.safetensors"))
    for name in a:
        assert (tmp_path / "sharded" / name).read_bytes() == (tmp_path / "sharded_plain" / name).read_bytes()


def _tampered(path: Path, layout: PackedLayout, change: str) -> None:
    table = layout.to_data()
    if change == "shape":
        table["entries"][1][2] = [9, 6]  # model.w1 claims a row more than was stored
    elif change == "dtype":
        table["entries"][0][1] = "float64"
    elif change == "dropped":
        table["entries"].pop()
    elif change == "segment_bytes":
        table["segment_bytes"] = 10**9
    fx.add_table(path, table, keys=[])


@pytest.mark.parametrize("change", ["shape", "dtype", "dropped", "segment_bytes"])
def test_a_table_that_does_not_match_the_segments_fails_before_anything_is_written(packed_w2, change) -> None:
    path, layout, tensors = packed_w2
    _tampered(path, layout, change)
    with pytest.raises(IntegrityError, match="does not match the segments"):
        open_checkpoint(path, level="none")
    # a planner handed the raw metadata checks it too, before it plans a read: no target is touched
    targets = {k: torch.full_like(v, 7.0) for k, v in tensors.items()}
    reader = fx.CountingReader(path, fx.read_raw(path))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        with pytest.raises(CheckpointException, match="does not match the segments"):
            dcp.load(fx._nested(targets), storage_reader=reader, planner=ShardlineLoadPlanner(), no_dist=True)
    assert not reader.items
    assert all(bool((t == 7.0).all()) for t in targets.values())


def test_torchs_planner_is_refused_on_a_packed_tensor(packed_w2) -> None:
    path, _, tensors = packed_w2
    targets = {k: torch.full_like(v, 7.0) for k, v in tensors.items()}
    with pytest.raises(CheckpointException, match="packed layout, which torch's load planner cannot read"):
        _load_whole(path, targets, planner=DefaultLoadPlanner())
    with pytest.raises(ConfigurationError, match="ShardlineLoadPlanner"):
        refuse_logical_reads(logical_metadata(fx.read_raw(path)), [MetadataIndex("model.w1", (0, 0))])


def _reads(layout: PackedLayout, rank: int, world: int, *, whole: bool) -> set[str]:
    """The segments rank ``rank`` of ``world`` needs for its row shards (or whole tensors) of every entry."""
    out = set()
    for i, entry in enumerate(layout.entries):
        rows = entry.shape[0]
        chunk = -(-rows // world)
        start, stop = (0, rows) if whole else (min(rank * chunk, rows), min((rank + 1) * chunk, rows))
        out |= {layout.locate(i, w)[0].key for w, _, _ in layout.sources(i, start, stop)}
    return out


@pytest.mark.slow
def test_row_sharded_loads_read_only_overlapping_segments_once_each(tmp_path: Path) -> None:
    tensors = fx.full_tensors()
    layouts = {
        "w2": fx.layout_for(tensors, W2, shard_dim=0, segment_bytes=96),
        "w1": fx.layout_for(tensors, (MeshSpec((1,), (0,)),), shard_dim=0, segment_bytes=96),
        # hybrid 2x2, rows split over mesh dimension 1; the first replica is ranks 3 and 2
        "hybrid": fx.layout_for(tensors, (MeshSpec((2, 2), (3, 2, 1, 0)),), shard_dim=1, segment_bytes=96),
    }
    for name, layout in layouts.items():
        fx.write_packed(tmp_path / name, layout, tensors)
    cases = {
        "shard-w2": "w2",
        "shard-w1": "w1",
        "shard-hybrid": "hybrid",
        "replicate-w2": "w2",
        "cols-w2": "w2",
    }
    out = run_distributed(
        packed_load_ranks.load_pieces, 2, args=({c: str(tmp_path / p) for c, p in cases.items()},), timeout=120
    )
    for rank, got in enumerate(out):
        for case, saved in cases.items():
            if case.startswith("cols"):
                continue
            result, layout = got[case], layouts[saved]
            assert all(result["equal"].values()), (rank, case, result["equal"])
            expected = _reads(layout, rank, 2, whole=case.startswith("replicate"))
            assert result["items"] == dict.fromkeys(expected, 1), (rank, case)
            storage = fx.read_raw(tmp_path / saved).storage_data
            assert result["bytes"] == sum(int(i.length) for x, i in storage.items() if x.fqn in expected)
        # the same layout: each rank reads exactly its own segments; hybrid: only the first replica's, its half
        assert set(got["shard-w2"]["items"]) == {s.key for s in layouts["w2"].segments(rank)}
        assert {k.split(".")[1] for k in got["shard-hybrid"]["items"]} == {"r3"} if rank == 0 else {"r2"}
        # a piece that is not whole rows: a clear error, before anything is read
        cols = got["cols-w2"]
        assert cols["untouched"]
        assert any(
            "CheckpointMismatchError" in e and "packed checkpoint loads into tensors sharded by rows" in e
            for e in cols["error"]
        )


def test_shardline_readers_read_packed_tensors_through_the_view(packed_w2) -> None:
    path, _, tensors = packed_w2
    # the verifying reader (loads, object stores)
    targets = {k: torch.full_like(v, 7.0) for k, v in tensors.items()}
    reader = VerifyingReader(path, logical_metadata(fx.read_raw(path)), to_hash=())
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.load(fx._nested(targets), storage_reader=reader, planner=ShardlineLoadPlanner(), no_dist=True)
        assert all(torch.equal(targets[k], t) for k, t in tensors.items())
        # DCP-native: shardline's Reader serves the view; torch's planner is refused, shardline's reads it
        targets = {k: torch.full_like(v, 7.0) for k, v in tensors.items()}
        with pytest.raises(CheckpointException, match="torch's load planner cannot read"):
            dcp.load(fx._nested(targets), storage_reader=Reader(path, level="none"), no_dist=True)
        assert all(bool((t == 7.0).all()) for t in targets.values())
        dcp.load(
            fx._nested(targets), storage_reader=Reader(path, level="none"), planner=ShardlineLoadPlanner(), no_dist=True
        )
    assert all(torch.equal(targets[k], t) for k, t in tensors.items())


def test_load_checks_and_loads_a_model_from_a_packed_checkpoint(tmp_path: Path) -> None:
    torch.manual_seed(0)
    saved = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3))
    tensors = {f"model.{k}": v.detach().clone() for k, v in saved.state_dict().items()}
    layout = fx.layout_for(tensors, (MeshSpec((1,), (0,)),), shard_dim=0, segment_bytes=64)
    fx.write_packed(tmp_path / "p", layout, tensors)
    fresh = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ckpt.load(tmp_path / "p", model=fresh, verify="none")
        for k, v in saved.state_dict().items():
            assert torch.equal(fresh.state_dict()[k], v), k
        # the model check sees the logical shapes: a model of another shape is refused by name
        other = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 3))
        with pytest.raises(CheckpointMismatchError, match=r"0\.weight"):
            ckpt.load(tmp_path / "p", model=other, verify="none")
        # a table edited to disagree with the segments: IntegrityError, the model untouched
        table = layout.to_data()
        table["entries"][0][2] = [6, 6]
        fx.add_table(tmp_path / "p", table, keys=[])
        with torch.no_grad():
            for p in fresh.parameters():
                p.fill_(3.0)
        with pytest.raises(IntegrityError, match="does not match the segments"):
            ckpt.load(tmp_path / "p", model=fresh, verify="none")
        assert all(bool((p == 3.0).all()) for p in fresh.parameters())


@pytest.mark.slow
def test_a_packed_checkpoint_in_a_bucket_consolidates_reading_each_segment_once(
    packed_w2, s3_env: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, layout, tensors = packed_w2
    url = f"s3://{S3_BUCKET}/{uuid.uuid4().hex[:12]}"
    s3_env.filesystem().put(str(path), url.removeprefix("s3://"), recursive=True)
    reads: list[tuple[str, int]] = []
    real = VerifyingReader._read_items

    def counted(self: VerifyingReader, name: str, items: list, planner: Any) -> None:
        reads.extend((name, offset) for offset, _, _ in self._groups(items))
        real(self, name, items, planner)

    monkeypatch.setattr(VerifyingReader, "_read_items", counted)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        consolidate(url, tmp_path / "s3.safetensors", verify="none")
        consolidate(path, tmp_path / "local.safetensors", verify="none")
    assert (tmp_path / "s3.safetensors").read_bytes() == (tmp_path / "local.safetensors").read_bytes()
    exported = load_file(tmp_path / "s3.safetensors")
    assert set(exported) == {key.removeprefix("model.") for key in tensors}
    assert all(torch.equal(exported[key.removeprefix("model.")], t) for key, t in tensors.items())
    segments = {s.key for r in range(2) for s in layout.segments(r)}
    assert len(reads) == len(set(reads)) == len(segments)  # each segment fetched once, nothing else read


@pytest.mark.slow
def test_a_packed_save_loads_resumes_and_consolidates_as_the_per_tensor_one(tmp_path: Path) -> None:
    trained = run_distributed(packed_load_ranks.save_both_layouts, 2, args=(str(tmp_path),), timeout=120)
    assert read_raw_layout(tmp_path / "packed") is not None
    assert read_raw_layout(tmp_path / "plain") is None
    for world in (2, 1):  # the saving world size, and W=2 -> W=1
        out = run_distributed(packed_load_ranks.load_both_layouts, world, args=(str(tmp_path),), timeout=120)
        plain_state, plain, packed_state, packed = out[0]
        _bitwise_equal(unpack(packed), unpack(trained[0]))  # model and optimizer, bit for bit
        _bitwise_equal(unpack(plain), unpack(trained[0]))
        _bitwise_equal(unpack(packed_state), unpack(plain_state))
    # consolidation: the same safetensors; inspect (the manifest's summary): the same model and contents
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        consolidate(tmp_path / "plain", tmp_path / "out-plain")
        consolidate(tmp_path / "packed", tmp_path / "out-packed")
    exported = sorted(p.name for p in (tmp_path / "out-plain").glob("*.safetensors"))
    assert exported == sorted(p.name for p in (tmp_path / "out-packed").glob("*.safetensors"))
    for name in exported:
        assert (tmp_path / "out-plain" / name).read_bytes() == (tmp_path / "out-packed" / name).read_bytes()
    plain_summary, packed_summary = summarize(tmp_path / "plain"), summarize(tmp_path / "packed")
    for key in ("step", "world_size", "parameters", "units", "strategies", "contents", "shard_files"):
        assert packed_summary[key] == plain_summary[key], key
    # a training run resumed from a packed checkpoint continues with the per-tensor resume's losses
    first, resumed = run_distributed(packed_load_ranks.resume_losses, 2, args=(str(tmp_path), "packed"), timeout=120)[0]
    first_plain, resumed_plain = run_distributed(
        packed_load_ranks.resume_losses, 2, args=(str(tmp_path), "per_tensor"), timeout=120
    )[0]
    assert resumed == resumed_plain == first[2:] == first_plain[2:]


def _bitwise_equal(a: Any, b: Any, where: str = "") -> None:
    """Same structure, keys (in any order), dtypes, shapes and bits."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert (a.dtype, a.shape) == (b.dtype, b.shape), where
        assert torch.equal(
            a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8)
        ), where
    elif isinstance(a, dict):
        assert isinstance(b, dict), where
        assert set(a) == set(b), where
        for key in a:
            _bitwise_equal(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b), where
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _bitwise_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def read_raw_layout(path: Path) -> PackedLayout | None:
    return packed_layout(fx.read_raw(path))


@pytest.mark.slow
def test_a_packed_hybrid_save_loads_into_hybrid_and_full_shard(tmp_path: Path) -> None:
    trained, hybrid, full_shard = run_distributed(
        packed_load_ranks.hybrid_to_full_shard, 4, args=(str(tmp_path),), timeout=120
    )[0]
    layout = read_raw_layout(tmp_path / "hybrid-packed")
    assert layout is not None
    assert any(len(mesh.shape) == 2 for mesh in layout.meshes)
    _bitwise_equal(unpack(hybrid), unpack(trained))
    _bitwise_equal(unpack(full_shard), unpack(trained))
