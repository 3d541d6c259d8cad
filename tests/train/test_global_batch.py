"""The global batch is invariant across world sizes; a step's samples (and their digest) do not depend on it."""

from __future__ import annotations

import hashlib

import pytest
import torch

from shardline.errors import ConfigurationError
from shardline.train.data import Batches, PackedBatches, batch_digest
from shardline.train.global_batch import plan_global_batch


def test_first_start_fixes_the_global_batch_and_a_resume_rederives_accumulation() -> None:
    first = plan_global_batch(micro_batch=4, accumulate=2, world_size=2)
    assert (first.global_batch, first.accumulate) == (16, 2)
    for world, accumulate in ((1, 4), (4, 1), (2, 2)):
        # the config still says accumulate=2: the recorded global batch decides
        plan = plan_global_batch(micro_batch=4, accumulate=2, world_size=world, recorded=16)
        assert (plan.global_batch, plan.accumulate) == (16, accumulate)
        assert plan.micro_batch * plan.accumulate * plan.world_size == 16
    configured = plan_global_batch(micro_batch=2, accumulate=7, world_size=2, configured=12)
    assert (configured.global_batch, configured.accumulate) == (12, 3)


def test_an_indivisible_global_batch_is_one_line_naming_the_numbers_and_the_fix() -> None:
    with pytest.raises(ConfigurationError) as info:
        plan_global_batch(micro_batch=4, accumulate=2, world_size=3, recorded=16)
    message = str(info.value)
    assert "\n" not in message
    for part in (
        "global batch",
        "is 16 sequences",
        "micro-batches of 4",
        "on 3 ranks",
        "run on a world size in [1, 2, 4]",
    ):
        assert part in message, message
    assert "trainer.micro_batch_size that divides" not in message, "16 / 3 is no integer: no micro-batch fits"
    with pytest.raises(ConfigurationError) as info:
        plan_global_batch(micro_batch=3, accumulate=1, world_size=2, configured=16)
    assert str(info.value).endswith("To continue, use a trainer.micro_batch_size that divides 8"), (
        "no world size fits 3"
    )
    with pytest.raises(
        ConfigurationError, match=r"trainer.global_batch_size=32, but the checkpoint .* global batch of 16"
    ):
        plan_global_batch(micro_batch=4, accumulate=2, world_size=2, configured=32, recorded=16)


@pytest.mark.parametrize("kind", [Batches, PackedBatches])
def test_a_step_has_the_same_samples_and_digest_at_every_world_size(kind: type) -> None:
    data = torch.arange(5_000) % 251
    whole = kind(data, seq_len=16, global_batch=12, rank=0, world_size=1, seed=7)
    for world in (2, 3, 4, 6):
        parts = [kind(data, seq_len=16, global_batch=12, rank=r, world_size=world, seed=7) for r in range(world)]
        for step in (0, 3, 40):  # 40: packed batches run into later epochs
            assert {p.digest(step) for p in parts} == {whole.digest(step)}
            assert torch.equal(torch.cat([p.local(step)[0] for p in parts]), whole.local(step)[0])
    digests = [whole.digest(step) for step in range(30)]
    assert len(set(digests)) == 30, "each step's batch is named apart"
    other_seed = kind(data, seq_len=16, global_batch=12, rank=0, world_size=1, seed=8)
    assert other_seed.digest(0) != whole.digest(0), "the digest names the samples, not only the step"


def test_digest_is_a_hash_of_the_sample_identities_in_order() -> None:
    ids = torch.tensor([5, 1, 9], dtype=torch.int64)
    expected = hashlib.sha256(b"".join(int(i).to_bytes(8, "little", signed=True) for i in (5, 1, 9))).hexdigest()
    assert batch_digest(ids) == expected[:16]
    assert batch_digest(ids.flip(0)) != batch_digest(ids)


def test_hybrid_degrees_follow_an_elastic_restart_or_refuse_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from shardline.train.config import compose_config, shard_degrees, to_train_config, validate

    # torchrun says 4 ranks at first start, then 2 after a node was lost; the config still says devices=4.
    free = to_train_config(
        compose_config(["trainer.strategy=hsdp", "trainer.devices=4", "trainer.strategy.shard_size=2"])
    )
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert shard_degrees(free) == (2, 2)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert shard_degrees(free) == (1, 2), "the free replicate degree is re-derived from the new world size"
    fixed = to_train_config(
        compose_config(
            ["trainer.strategy=hsdp", "trainer.devices=4", "trainer.strategy.shard_size=2",
             "trainer.strategy.replicate_size=2"]
        )
    )  # fmt: skip
    with pytest.raises(ConfigurationError) as info:
        validate(fixed, launched=True)
    message = str(info.value)
    assert "world size 2 from the launcher" in message, message
    assert "leave one at -1" in message, message
