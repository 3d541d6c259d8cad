"""The trainer-state safety check: recognised by its types without loading it back; anything else still loaded."""

from __future__ import annotations

import collections
import io
import random

import numpy as np
import pytest
import torch

from shardline.checkpoint.format.dcp_io import decode_state, encode_state
from shardline.checkpoint.format.safe_state import plainly_safe
from shardline.errors import ConfigurationError


def _trainer_state() -> dict[str, object]:
    return {
        "step": 100,
        "epoch": 1,
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy_seed": 7},
        "scheduler": {"last_epoch": 100, "base_lrs": [1e-3], "_last_lr": [1e-3]},
        "loader": {"position": 12345, "name": "train", "token": b"\x00\x01", "done": None, "ratio": 0.5},
        "ema": torch.randn(3, 4).t(),  # a non-contiguous view
        "half": torch.zeros(2, dtype=torch.bfloat16),
    }


class _Custom:
    pass


def _with_attribute() -> torch.Tensor:
    t = torch.zeros(2)
    t.owner = _Custom()  # type: ignore[attr-defined]
    return t


def _loads_safely(obj: object) -> bool:
    buf = io.BytesIO()
    torch.save(obj, buf)
    try:
        torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    except Exception:
        return False
    return True


def test_a_plain_trainer_state_is_saved_without_loading_it_back(monkeypatch) -> None:
    loads: list[object] = []
    real_load = torch.load

    def counting(*args: object, **kwargs: object) -> object:
        loads.append(args)
        return real_load(*args, **kwargs)  # type: ignore[arg-type]

    state = _trainer_state()
    monkeypatch.setattr(torch, "load", counting)
    data = encode_state(state, "trainer state")
    assert loads == [], "a state of plain types was loaded back to check it"
    monkeypatch.undo()
    back = decode_state(data)
    assert back["rng"]["python"] == state["rng"]["python"]
    assert torch.equal(back["ema"], state["ema"])
    assert torch.equal(back["rng"]["torch"], state["rng"]["torch"])


@pytest.mark.parametrize(
    "value",
    [np.zeros(3), _Custom(), _with_attribute(), collections.Counter(a=1), torch.zeros(2).to_sparse()],
    ids=["numpy", "custom-class", "tensor-attribute", "dict-subclass", "sparse"],
)
def test_anything_else_is_still_loaded_back_and_refused_if_unsafe(value: object) -> None:
    state = {"step": 1, "extra": [value]}
    assert not plainly_safe(state)
    if _loads_safely(state):  # recognised or not, a state the safe load restores is saved
        encode_state(state, "trainer state")
        return
    with pytest.raises(ConfigurationError, match="weights_only"):
        encode_state(state, "trainer state")


def test_what_is_recognised_always_loads_safely() -> None:
    cyclic: list[object] = [1]
    cyclic.append(cyclic)
    deep: object = 0
    for _ in range(100):
        deep = [deep]
    samples = [
        _trainer_state(),
        {},
        {2: "a", None: 2, 1.5: 3, b"k": 1, True: 0},
        {(1, 2): 3},  # a tuple key: not recognised (still saved, after the load check)
        [1 + 2j, "s", (None, False)],
        torch.zeros(2, 2, dtype=torch.complex64).conj(),
        cyclic,
        deep,
    ]
    for sample in samples:
        if plainly_safe(sample):
            assert _loads_safely(sample), sample
    assert plainly_safe(_trainer_state())
    assert not plainly_safe(cyclic)
    assert not plainly_safe(deep)
