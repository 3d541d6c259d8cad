"""shardline's writer threads save their records without torch.save's CRC-32, and nobody else's saves change.

The CRC-32 is work no reader checks (the first test shows ``torch.load`` taking a flipped byte); the file's SHA-256
covers the same bytes. Where torch keeps the switch per context (2.13 and later), every record of a shardline save
carries zeros in its CRC fields and loads with plain DCP; where it keeps one per process (2.11), shardline leaves it
alone and its records carry their CRC-32 as plain DCP's do. Either way the threads around a save -- the caller's,
one saving beside it, a plain DCP save after it -- keep theirs. Part of the compatibility subset: the switch's
scope is what differs between torch releases.
"""

from __future__ import annotations

import io
import threading
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import shardline
import shardline.checkpoint as ckpt
from shardline import _torch_compat
from shardline.testing import run_distributed

pytestmark = pytest.mark.compat


def _records(directory: Path) -> dict[str, list[zipfile.ZipInfo]]:
    """Every torch.save record of a DCP checkpoint's tensors, by item: the archive entries (with their CRC fields)."""
    metadata = dcp.FileSystemReader(str(directory)).read_metadata()
    out: dict[str, list[zipfile.ZipInfo]] = {}
    for index, info in metadata.storage_data.items():
        with open(directory / info.relative_path, "rb") as f:
            f.seek(info.offset)
            raw = f.read(info.length)
        if raw[:4] == b"PK\x03\x04":  # a tensor item (bytes items are stored raw)
            out[f"{index.fqn}@{index.offset}"] = zipfile.ZipFile(io.BytesIO(raw)).infolist()
    return out


def _crc_ok(data: bytes) -> bool:
    """Whether every entry of a torch.save archive carries its true CRC-32 (zipfile checks it on reading)."""
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        return archive.testzip() is None and all(info.CRC != 0 for info in archive.infolist() if info.file_size)


def _saved(obj: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def save_beside_others(rank: int, world: int, root: str) -> dict[str, object]:
    """Rank function: a sync and an async save while another thread torch.saves in a loop, then the caller's own
    torch.save and a plain DCP save; what each wrote (CRCs intact or not) and what the ranks hold."""
    torch.manual_seed(rank)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 32))
    shardline.wrap(model, shardline.layer_policy(nn.Linear))
    beside: list[bool] = []
    done = threading.Event()

    def keep_saving() -> None:
        payload = torch.arange(4096, dtype=torch.float32)
        while not done.is_set():
            beside.append(_crc_ok(_saved(payload)))

    other = threading.Thread(target=keep_saving)
    other.start()
    try:
        ckpt.save(Path(root) / "sync", model=model, step=1)
        with ckpt.CheckpointManager(Path(root) / "managed", async_save=True) as manager:
            manager.save(ckpt.SaveRequest(step=2, model=model))
            manager.wait()
    finally:
        done.set()
        other.join()
    caller = _crc_ok(_saved(torch.ones(16)))
    plain = {"model": ckpt.model_state_dict(model)}
    dcp.save(plain, checkpoint_id=str(Path(root) / "plain"))
    loaded = {"model": ckpt.model_state_dict(model)}
    dcp.load(loaded, checkpoint_id=str(Path(root) / "sync"))  # plain DCP reads shardline's records
    same = all(
        torch.equal(loaded["model"][k].full_tensor(), v.full_tensor()) for k, v in ckpt.model_state_dict(model).items()
    )
    return {
        "beside": beside,
        "caller": caller,
        "switch_after": torch.serialization.get_crc32_options(),
        "plain_dcp_loads_it": same,
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, object]]]:
    root = tmp_path_factory.mktemp("record-crc")
    return root, run_distributed(save_beside_others, 2, args=(str(root),), timeout=90)


def test_torch_load_never_checks_the_crc() -> None:
    """Why skipping it loses nothing: a record with a flipped data byte and its CRC-32 intact loads without a word."""
    data = bytearray(_saved(torch.arange(1000, dtype=torch.float32)))
    at = data.find(torch.tensor([500.0]).numpy().tobytes())
    data[at] ^= 1
    assert not _crc_ok(bytes(data))  # the CRC does disagree with the bytes
    assert torch.load(io.BytesIO(bytes(data)), weights_only=True)[500].item() != 500.0


def test_records_skip_the_crc_only_where_torch_scopes_the_switch(
    saved: tuple[Path, list[dict[str, object]]],
) -> None:
    root, _ = saved
    managed = next((root / "managed").glob("step-*"))
    for name, directory in (("sync", root / "sync"), ("async", managed)):
        records = _records(directory)
        assert len(records) >= 4, f"{name}: the two ranks' weight and bias shards"
        crcs = {key: [info.CRC for info in infos if info.file_size] for key, infos in records.items()}
        if _torch_compat.SAVE_CRC32_PER_CONTEXT:
            assert all(set(values) == {0} for values in crcs.values()), f"{name}: a record kept its CRC-32: {crcs}"
        else:  # torch 2.11: one switch per process, left alone
            assert all(0 not in values for values in crcs.values()), f"{name}: a record lost its CRC-32: {crcs}"


def test_no_other_save_changes(saved: tuple[Path, list[dict[str, object]]]) -> None:
    root, results = saved
    for rank, result in enumerate(results):
        beside = result["beside"]
        assert isinstance(beside, list)
        assert len(beside) > 0, f"rank {rank}: the other thread saved nothing"
        assert all(beside), (
            f"rank {rank}: {beside.count(False)} of {len(beside)} saves beside shardline's lost their CRC"
        )
        assert result["caller"] is True, f"rank {rank}: the caller's torch.save after shardline's lost its CRC-32"
        assert result["switch_after"] is True
        assert result["plain_dcp_loads_it"] is True, f"rank {rank}: plain dcp.load read other values"
    plain = _records(root / "plain")
    assert plain
    assert all(all(info.CRC != 0 for info in infos if info.file_size) for infos in plain.values())
