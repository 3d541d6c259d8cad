"""The device coordination messages travel on follows the group's backends, whatever its name reads."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardline.checkpoint.coordination import coord


@pytest.mark.parametrize(
    ("name", "config", "cuda", "expected"),
    [
        ("gloo", "cpu:gloo", False, "cpu"),
        ("cpu:gloo,cuda:nccl", "cpu:gloo,cuda:nccl", True, "cpu"),
        ("undefined", "undefined", False, "cpu"),  # Accelerate's PartialState() before TrainingArguments
        ("undefined", "cpu:gloo", True, "cpu"),
        ("nccl", "cuda:nccl", True, "cuda"),
    ],
)
def test_control_device(monkeypatch: pytest.MonkeyPatch, name: str, config: str, cuda: bool, expected: str) -> None:
    monkeypatch.setattr(dist, "get_backend", lambda group=None: name)
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: config)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert coord.control_device(None).type == expected
