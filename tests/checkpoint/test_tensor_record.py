"""The verified reader's tensor decoder: equal to ``torch.load`` wherever it answers, ``None`` elsewhere.

``decode_tensor`` reads a ``torch.save`` archive that is already in memory as a view of its bytes.
These tests hold it to ``torch.load(weights_only=True)`` on every dtype and layout DCP stores,
check that everything outside a plain dense tensor is declined (so ``torch.load`` decides), that a
hostile pickle is never executed, and that a record that does not match its pickle is refused.
"""

from __future__ import annotations

import ctypes
import io
import os
import pickle
import subprocess
import sys
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from shardline.checkpoint.format.tensor_record import decode_tensor

pytestmark = pytest.mark.compat  # torch.save's pickle and zip layout, as the installed torch writes them


def _saved(obj: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _rewritten(data: bytes, replace: dict[str, bytes]) -> bytes:
    """``data``'s archive, stored anew, with each record whose name ends in a key of ``replace`` swapped."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            body = src.read(info)
            for suffix, value in replace.items():
                if info.filename.endswith(suffix):
                    body = value
            dst.writestr(info.filename, body)
    return out.getvalue()


def _pickle_of(data: bytes) -> bytes:
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        return archive.read(next(n for n in archive.namelist() if n.endswith("/data.pkl")))


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as raw bytes (``torch.equal`` lacks kernels for some dtypes, e.g. float8)."""
    return tensor.reshape(-1).contiguous().view(torch.uint8)


def _cases() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(6, 5, generator=gen)
    cases = {
        "float32": base,
        "float64": base.double(),
        "float16": base.half(),
        "bfloat16": base.bfloat16(),
        "int8": (base * 10).to(torch.int8),
        "int64": torch.arange(-7, 8),
        "uint8": torch.arange(0, 250, 7, dtype=torch.uint8),
        "bool": base > 0,
        "complex64": torch.complex(base, -base),
        "scalar": torch.tensor(3.25),
        "empty": torch.empty(0, 4),
        "transposed": base.t(),
        "offset_view": base[2:, 1:4],
        "strided": base[::2, ::3],
        "expanded": torch.arange(3.0).expand(4, 3),
    }
    for name in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32"):  # saved through the v3 rebuild
        dtype = getattr(torch, name, None)
        if dtype is not None:
            cases[name] = torch.arange(12).reshape(3, 4).to(dtype)
    return cases


@pytest.mark.parametrize("name", sorted(_cases()))
def test_decodes_like_torch_load(name: str) -> None:
    tensor = _cases()[name]
    data = _saved(tensor)
    expected = torch.load(io.BytesIO(data), weights_only=True)
    decoded = decode_tensor(data)
    assert decoded is not None, f"a plain {name} tensor must not fall back to torch.load"
    assert decoded.dtype == expected.dtype
    assert decoded.size() == expected.size()
    assert decoded.stride() == expected.stride()
    assert decoded.storage_offset() == expected.storage_offset()
    assert torch.equal(_bits(decoded), _bits(expected))


def test_is_a_view_of_the_bytes_not_a_copy() -> None:
    data = _saved(torch.arange(1000.0))
    decoded = decode_tensor(data)
    assert decoded is not None
    address = decoded.untyped_storage().data_ptr()
    # The storage lies inside ``data``: nothing was copied out of the archive.
    begin = ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value
    assert begin is not None
    assert begin <= address < begin + len(data)
    assert torch.equal(decoded, torch.arange(1000.0))


def _quantized() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # quantized creation is deprecated; still saved by torch.save
        return torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.nn.Parameter(torch.ones(3)),
        lambda: {"weight": torch.ones(3)},
        lambda: [torch.ones(2), torch.zeros(2)],
        lambda: torch.ones(4, 4).to_sparse(),
        _quantized,
        lambda: 7,
    ],
    ids=["parameter", "dict", "list", "sparse", "quantized", "int"],
)
def test_declines_anything_but_a_plain_tensor(make: Callable[[], object]) -> None:
    assert decode_tensor(_saved(make())) is None


def test_declines_other_byte_order_and_compressed_or_non_zip_bytes() -> None:
    data = _saved(torch.arange(5.0))
    other = "big" if sys.byteorder == "little" else "little"
    assert decode_tensor(_rewritten(data, {"/byteorder": other.encode()})) is None
    deflated = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(deflated, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info))
    assert decode_tensor(deflated.getvalue()) is None
    assert decode_tensor(b"not an archive at all") is None
    assert decode_tensor(b"") is None


def test_a_hostile_pickle_is_declined_and_never_executed(tmp_path: Path) -> None:
    marker = tmp_path / "executed"

    class Payload:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.system, (f"touch {marker}",))

    hostile = pickle.dumps(Payload(), protocol=2)
    data = _rewritten(_saved(torch.arange(5.0)), {"/data.pkl": hostile})
    assert decode_tensor(data) is None
    assert not marker.exists(), "decode_tensor executed a global the tensor pickle does not name"


@pytest.mark.parametrize("damage", ["truncated", "v2_called_as_v3", "bad_opcode"])
def test_a_damaged_pickle_is_declined_and_torch_load_refuses_it(damage: str) -> None:
    """Damage inside ``data.pkl`` goes to torch.load, whose refusal the reader reports (never a result)."""
    data = _saved(torch.arange(6.0))
    pkl = _pickle_of(data)
    assert pkl.count(b"_rebuild_tensor_v2") == 1
    damaged, refusal = {
        "truncated": (pkl[: len(pkl) // 2], EOFError),
        # one bit, as a flipped byte would: v3 takes one argument more
        "v2_called_as_v3": (pkl.replace(b"_rebuild_tensor_v2", b"_rebuild_tensor_v3"), TypeError),
        "bad_opcode": (pkl[:2] + b"\xff" + pkl[3:], pickle.UnpicklingError),
    }[damage]
    bad = _rewritten(data, {"/data.pkl": damaged})
    assert decode_tensor(bad) is None
    with pytest.raises(refusal):
        torch.load(io.BytesIO(bad), weights_only=True)


def test_a_record_shorter_than_its_pickle_promises_is_refused() -> None:
    data = _saved(torch.arange(8.0))
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        record = next(n for n in archive.namelist() if "/data/" in n)
    short = _rewritten(data, {record: b"\0" * 12})
    with pytest.raises(ValueError, match="holds 12 bytes where its pickle promises 32"):
        decode_tensor(short)
    with pytest.raises(RuntimeError, match="record size"):  # torch.load refuses it too: the decoder is no laxer
        torch.load(io.BytesIO(short), weights_only=True)


def test_a_view_past_its_record_raises_instead_of_reading_out_of_bounds() -> None:
    """A pickle whose size overruns its storage must raise, never read past the buffer (child process)."""
    script = (
        "import io, torch\n"
        "from shardline.checkpoint.format.tensor_record import decode_tensor\n"
        "from tests.checkpoint.test_tensor_record import _saved, _rewritten, _pickle_of\n"
        "data = _saved(torch.arange(7.0))\n"
        "pkl = _pickle_of(data)\n"
        "assert pkl.count(b'K\\x07\\x85') == 1, pkl\n"  # size (7,) as BININT1 7, TUPLE1
        "bad = _rewritten(data, {'/data.pkl': pkl.replace(b'K\\x07\\x85', b'K\\xfa\\x85')})\n"
        "try:\n"
        "    decode_tensor(bad)\n"
        "except RuntimeError as exc:\n"
        "    print('refused:', exc)\n"
        "else:\n"
        "    raise SystemExit('a view of 250 elements over a record of 7 was accepted')\n"
    )
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=100, cwd=root)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "refused:" in proc.stdout


def test_every_tensor_item_of_a_saved_checkpoint_takes_the_decoder(saved_run: Path) -> None:
    """The fast path is the path: DCP's own items decode (no silent fallback) and equal torch.load."""
    step = saved_run / "step-4"
    metadata = FileSystemReader(str(step)).read_metadata()
    decoded_items = 0
    for index, info in metadata.storage_data.items():
        if not isinstance(metadata.state_dict_metadata[index.fqn], TensorStorageMetadata):
            continue  # a BYTE_IO item (trainer state, config): a pickled object, not a tensor
        with open(step / info.relative_path, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        decoded = decode_tensor(data)
        assert decoded is not None, f"{info.relative_path}@{info.offset} fell back to torch.load"
        assert torch.equal(decoded, torch.load(io.BytesIO(data), weights_only=True))
        decoded_items += 1
    assert decoded_items > 0
