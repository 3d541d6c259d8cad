"""One vocabulary for how much is verified: ``verify_checkpoint``, ``check_checkpoint`` and ``open_checkpoint``
take ``level=`` (a :class:`VerifyLevel` or its name); the older ``verify=`` keyword warns and still works."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from shardline.checkpoint import VerifyLevel, verify_checkpoint
from shardline.checkpoint.integrity.opening import open_checkpoint
from shardline.checkpoint.lifecycle.load import check_checkpoint
from shardline.errors import CheckpointWarning, ConfigurationError, IntegrityError


def _step(result: Any) -> int:
    """The checkpoint's step, whichever verifier answered."""
    if hasattr(result, "checked"):  # OpenedCheckpoint
        return int(result.checked.manifest["step"])
    if isinstance(result, dict):  # check_checkpoint's manifest
        return int(result["step"])
    assert result.ok, result  # verify_checkpoint's report
    return int(result.step)


def _check(path: Path, **kw: Any) -> Any:
    return check_checkpoint(path, **kw)


def _open(path: Path, **kw: Any) -> Any:
    return open_checkpoint(path, **kw)


def _verify(path: Path, **kw: Any) -> Any:
    return verify_checkpoint(path, **kw)


READERS: dict[str, Callable[..., Any]] = {"check_checkpoint": _check, "open_checkpoint": _open}
VERIFIERS: dict[str, Callable[..., Any]] = {**READERS, "verify_checkpoint": _verify}


@pytest.fixture(autouse=True)
def _no_deprecation() -> Iterator[None]:
    """The new keyword never warns about itself; opt-in levels say so with a CheckpointWarning (not checked here)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        warnings.simplefilter("ignore", CheckpointWarning)
        yield


def _levels(name: str) -> list[Any]:
    names = ["full", "sizes"] if name == "verify_checkpoint" else ["full", "sizes", "none"]
    return [*names, *(VerifyLevel(n) for n in names)]


@pytest.mark.parametrize("name", sorted(VERIFIERS))
def test_every_verifier_takes_level_with_each_level(saved_run: Path, name: str) -> None:
    for level in _levels(name):
        assert _step(VERIFIERS[name](saved_run / "step-4", level=level)) == 4, level


@pytest.mark.parametrize("name", sorted(READERS))
def test_level_is_honoured(damaged_copy: Path, name: str) -> None:
    shard = damaged_copy / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # same size: only hashing sees it
    shard.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=r"__0_0\.distcp"):
        READERS[name](damaged_copy, level="full")
    assert _step(READERS[name](damaged_copy, level=VerifyLevel.SIZES)) == 4
    assert not verify_checkpoint(damaged_copy, level="full").ok
    assert verify_checkpoint(damaged_copy, level="sizes").ok


@pytest.mark.parametrize("name", sorted(VERIFIERS))
def test_an_unknown_level_names_the_valid_ones(saved_run: Path, name: str) -> None:
    with pytest.raises(ConfigurationError, match=r"unknown verification level 'everything'; use one of full, sizes"):
        VERIFIERS[name](saved_run / "step-4", level="everything")


@pytest.mark.parametrize("name", sorted(READERS))
def test_the_old_verify_keyword_warns_and_still_works(damaged_copy: Path, name: str) -> None:
    shard = damaged_copy / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.warns(DeprecationWarning, match=rf"{name}\(verify=...\) is deprecated: pass level='sizes'"):
        assert _step(READERS[name](damaged_copy, verify="sizes")) == 4
    with pytest.warns(DeprecationWarning, match="pass level='full'"), pytest.raises(IntegrityError):
        READERS[name](damaged_copy, verify=VerifyLevel.FULL)
    with (
        pytest.warns(DeprecationWarning, match="verify= stops being accepted"),
        pytest.raises(ConfigurationError, match="pass level= only"),
    ):
        READERS[name](damaged_copy, level="sizes", verify="none")
