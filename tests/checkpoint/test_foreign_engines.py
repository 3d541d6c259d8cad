"""Checkpoints of models sharded by torch's engines: FSDP2 (1-D and a 2-D HSDP mesh), FSDP1, DDP, and plain models.

One launch at W=2 trains, saves, verifies and resumes every engine (a resume at the same world
size continues bit for bit); one launch at W=1 loads each of those checkpoints into a one-rank
model of its engine and into a plain model (the loss curve agrees with the uninterrupted W=2
run under tests.numerics' trajectory rule), and refuses a copy with one byte flipped.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from shardline.checkpoint.lifecycle.load import check_checkpoint
from shardline.cli import main as cli_main
from shardline.testing import run_distributed
from tests.checkpoint import foreign_ranks
from tests.numerics import assert_trajectories

pytestmark = pytest.mark.slow

ENGINES = list(foreign_ranks.ENGINES)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """Every engine trained, saved at step 2 and resumed at W=2 (one launch)."""
    root = tmp_path_factory.mktemp("foreign")
    results = run_distributed(foreign_ranks.save_and_resume, 2, args=(str(root), ENGINES), timeout=150)
    return root, results[0]


@pytest.fixture(scope="module")
def at_one_rank(saved: tuple[Path, dict[str, Any]]) -> tuple[dict[str, Any], dict[str, str]]:
    """Each W=2 checkpoint loaded at W=1 into its own engine and into a plain model, plus its damaged copy."""
    root, _ = saved
    (root / "one-rank").mkdir()
    flipped = {e: foreign_ranks.flip_byte(str(root / e), str(root / f"{e}-damaged")) for e in ENGINES}
    results = run_distributed(
        foreign_ranks.resume_elsewhere, 1, args=(str(root), ENGINES, [*ENGINES, "plain"]), timeout=150
    )
    return results[0], flipped


@pytest.mark.parametrize("engine", ENGINES)
def test_resume_at_the_same_world_size_is_bit_identical(saved: tuple[Path, dict[str, Any]], engine: str) -> None:
    _, results = saved
    result = results[engine]
    assert "error" not in result, result.get("error")
    assert result["resumed"] == result["reference"]  # bit for bit: same kernels, same order
    assert result["first"] != result["reference"]  # training moved: the comparison is of real steps


@pytest.mark.parametrize("engine", ENGINES)
def test_checkpoint_verifies_and_records_its_engine(saved: tuple[Path, dict[str, Any]], engine: str) -> None:
    root, _ = saved
    manifest = check_checkpoint(root / engine)
    assert manifest is not None
    sharding = manifest["sharding"]
    assert sharding["engine"] == ("fsdp2" if engine == "hsdp" else engine)
    assert manifest["strategies"] == {}
    assert manifest["units"] == []
    assert manifest["model"]["state"]["blocks.0.fc1.weight"] == [[7, 10], "float32"]  # global shape, no prefix
    if engine == "fsdp2":
        assert sharding["mesh"] == {"shape": [2], "dim_names": None}
        assert sharding["parameters"]["blocks.0.fc1.weight"] == "Shard(dim=0)"
        assert sharding["modules"]["blocks.0"]["reshard_after_forward"] is True
        assert sharding["modules"]["<root>"]["mixed_precision"]["param_dtype"] is None
    elif engine == "hsdp":
        assert sharding["mesh"] == {"shape": [2, 1], "dim_names": ["replicate", "shard"]}
        assert sharding["parameters"]["blocks.1.gate"] == "Replicate(), Shard(dim=0)"
    elif engine == "fsdp1":
        assert sharding["state_dict_type"] == "SHARDED_STATE_DICT"
        assert sharding["modules"]["<root>"]["sharding_strategy"] == "FULL_SHARD"
        assert set(sharding["modules"]) == {"<root>", "blocks.0", "blocks.1"}
    else:
        assert sharding == {"engine": "ddp", "parameters": "replicated"}


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("into", ["same", "plain"])
def test_resume_at_one_rank(
    saved: tuple[Path, dict[str, Any]], at_one_rank: tuple[dict[str, Any], dict[str, str]], engine: str, into: str
) -> None:
    _, results = saved
    loaded, _ = at_one_rank
    losses = loaded[f"{engine}->{engine if into == 'same' else 'plain'}"]
    assert isinstance(losses, list), losses
    # W=2 -> W=1 sums the batch in another order: the trajectory rule of tests.numerics, not equality.
    assert_trajectories(losses, results[engine]["reference"], f"{engine} resumed at W=1 ({into})")


@pytest.mark.parametrize("engine", ENGINES)
def test_a_flipped_byte_is_refused(at_one_rank: tuple[dict[str, Any], dict[str, str]], engine: str) -> None:
    loaded, flipped = at_one_rank
    kind, message = loaded[f"{engine}-damaged"]
    assert kind == "IntegrityError", message
    assert flipped[engine] in message


def test_inspect_says_how_the_model_was_sharded(
    saved: tuple[Path, dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    root, _ = saved
    words = {}
    for engine in ENGINES:
        assert cli_main(["inspect", str(root / engine)]) == 0
        words[engine] = capsys.readouterr().out
    assert "torch FSDP2 (fully_shard)" in words["fsdp2"]
    assert "a 1-D mesh of 2 ranks" in words["fsdp2"]
    assert "reshard after forward" in words["fsdp2"]
    assert "2 x 1 mesh (replicate x shard)" in words["hsdp"]
    assert "FSDP1" in words["fsdp1"]
    assert "FULL_SHARD" in words["fsdp1"]
    assert "DistributedDataParallel" in words["ddp"]
    assert "replicated" in words["ddp"]
    assert cli_main(["inspect", "--json", str(root / "fsdp2")]) == 0
    assert json.loads(capsys.readouterr().out)["sharding"]["engine"] == "fsdp2"


def test_manager_round_trip_and_refusals(tmp_path: Path) -> None:
    """A CheckpointManager saves and resumes an FSDP1 model; models it cannot describe are refused by name."""
    results = run_distributed(foreign_ranks.manager_round_trip, 2, args=(str(tmp_path / "run"), "fsdp1"), timeout=120)
    reference, resumed = results[0]
    assert resumed == reference
    refusals = run_distributed(foreign_ranks.refused, 2, args=(str(tmp_path),), timeout=120)[0]
    kind, message = refusals["nested_ddp"]
    assert kind == "ConfigurationError"
    assert "'blocks.0'" in message
    assert "DistributedDataParallel" in message
    kind, message = refusals["mixed"]
    assert kind == "ConfigurationError"
    assert "mixes sharding engines" in message
    assert "FSDP2" in message
    assert "shardline.wrap" in message


def test_a_plain_model_resumes_bit_identically_and_says_it_is_unsharded(
    saved: tuple[Path, dict[str, Any]], at_one_rank: tuple[dict[str, Any], dict[str, str]]
) -> None:
    root, _ = saved
    loaded, _ = at_one_rank
    result = loaded["plain"]
    assert "error" not in result, result.get("error")
    assert result["resumed"] == result["reference"]
    manifest = check_checkpoint(root / "one-rank" / "plain")
    assert manifest is not None
    assert manifest["sharding"] == {"engine": "plain", "parameters": "replicated"}
