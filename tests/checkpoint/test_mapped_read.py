"""A verified load reads local files through a read-only mapping: same state, nothing left mapped, damage still found."""

from __future__ import annotations

from pathlib import Path

import shardline.checkpoint as ckpt
from shardline.testing import run_distributed
from tests.checkpoint import ranks


def load_and_list_mappings(rank: int, world: int, path: str) -> tuple[bytes, list[str], tuple[str, str]]:
    """Load ``path`` (verify=full); the checkpoint files this process still maps afterwards; a damaged load's error."""
    model, optimizer = ranks.build(seed=123)
    ckpt.load(path, model=model, optimizer=optimizer, verify="full")
    taken = ranks.snapshot(model, optimizer)
    maps = Path("/proc/self/maps").read_text()
    mapped = sorted({line.split()[-1] for line in maps.splitlines() if path in line})
    damaged = Path(path) / "__0_1.distcp"
    data = bytearray(damaged.read_bytes())
    data[-100] ^= 0x01  # in the archive's trailer, past every tensor record: only the hash can see it
    damaged.write_bytes(bytes(data))
    return taken, mapped, ranks.catch(ckpt.load, path, model=model, optimizer=optimizer, verify="full")


def test_a_mapped_verified_load_restores_the_state_and_unmaps_every_file(tmp_path: Path) -> None:
    path = tmp_path / "step-2"
    ((_, saved),) = run_distributed(ranks.save_trained, 1, args=(str(path), "full_shard", False, "full", 2), timeout=60)
    assert sorted(p.name for p in path.glob("*.distcp")) == ["__0_0.distcp", "__0_1.distcp"]
    ((taken, mapped, (kind, message)),) = run_distributed(load_and_list_mappings, 1, args=(str(path),), timeout=60)
    assert taken == saved
    assert mapped == []  # every mapping was closed when its file was verified
    assert kind == "IntegrityError"
    assert "__0_1.distcp: altered (sha256" in message


def test_a_file_system_that_cannot_map_files_is_read_by_streaming(tmp_path: Path, monkeypatch) -> None:
    import errno
    import mmap

    from shardline.checkpoint.integrity.reading import VerifyingReader

    data = tmp_path / "f.distcp"
    data.write_bytes(b"x" * 4096)
    (tmp_path / "empty.distcp").write_bytes(b"")
    mapped = VerifyingReader._map(data)
    assert isinstance(mapped, mmap.mmap)
    assert mapped[:4] == b"xxxx"
    mapped.close()
    assert VerifyingReader._map(tmp_path / "empty.distcp") == b""  # nothing to map; hashed as empty

    def refuse(*_args, **_kwargs):
        raise OSError(errno.ENODEV, "No such device")

    monkeypatch.setattr(mmap, "mmap", refuse)
    assert VerifyingReader._map(data) is None  # the caller streams the file instead
