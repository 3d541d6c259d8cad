"""A bitsandbytes 4-bit frozen base with LoRA adapters, sharded: parity at W=1, 2, 4, memory, the pre-step check.

One launch of four ranks runs everything (tests/bnb_ranks.py): the plain model on the whole
batch (the reference), the same model sharded over process groups of 1, 2 and 4 ranks, and the
faults: a quant_state lost before wrapping, the absmax state dropped while sharding, a weight
replaced after wrapping by a plain Parameter of its bytes.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shardline.testing import run_distributed
from tests.models import chain_terms
from tests.numerics import Reorder, assert_caught, assert_reordered, assert_trajectories, close_ratio, max_rel_err

pytest.importorskip("bitsandbytes")
from tests import bnb_ranks as br
from tests import qlora_ranks as qr

pytestmark = [pytest.mark.slow, pytest.mark.numerics]


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return run_distributed(br.parity, 4, timeout=110)


def _grad_rule(world: int) -> Reorder:
    # Longest chain behind an adapter gradient: per block a LoRA projection (DIM + RANK terms), the MLP's
    # up (DIM + RANK) and down (HIDDEN) projections; the head (DIM); over the batch's tokens and the ranks.
    forward = 2 * (2 * (br.DIM + br.RANK) + br.HIDDEN) + br.DIM
    return Reorder(chain_terms(forward=forward, tokens=qr.BATCH * qr.SEQ, world_size=world))


def _grad_errors(actual: dict[str, list[float]], expected: dict[str, list[float]]) -> dict[str, float]:
    assert sorted(actual) == sorted(expected), (sorted(actual), sorted(expected))
    return {k: max_rel_err(torch.tensor(actual[k]), torch.tensor(expected[k])) for k in expected}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_bnb_qlora_parity(runs: list[dict[str, Any]], world: int) -> None:
    """First-step adapter gradients within the reordering bound, losses over 4 AdamW steps equal, on every rank."""
    for out in runs:
        ref_losses, ref_grads = out["reference"]
        losses, grads = out[f"run{world}"]
        assert sorted(grads) == sorted(out["adapters"])
        assert len(grads) == 8
        assert_reordered(_grad_errors(grads, ref_grads), _grad_rule(world), f"W={world} bnb adapter gradients")
        assert_trajectories(losses, ref_losses, f"W={world} bnb QLoRA")
        assert losses[-1] < losses[0]  # it trains
        if world == 1:  # one rank runs the plain model's kernels on the same operands: bit for bit
            assert losses == ref_losses
            assert grads == ref_grads


def test_bnb_parity_sees_a_dropped_absmax(runs: list[dict[str, Any]]) -> None:
    """With each weight's absmax replaced while sharding (check skipped), the same comparisons fail."""
    for out in runs:
        ref_losses, ref_grads = out["reference"]
        losses, grads = out["faulty_run"]
        assert_caught(_grad_errors(grads, ref_grads), _grad_rule(4), "dropped absmax: gradients")
        ratios = {f"step {i}": close_ratio(a, e) for i, (a, e) in enumerate(zip(losses, ref_losses, strict=True))}
        assert_caught(ratios, None, "dropped absmax: losses")


def test_bnb_refuses_a_lost_quant_state_naming_the_weight(runs: list[dict[str, Any]]) -> None:
    """A Params4bit whose quant_state is None (the FSDP2 failure) is refused when wrapped, by name."""
    for out in runs:
        message = out["lost_at_wrap"]
        assert message is not None, "a Params4bit without its quant_state was sharded"
        assert "'blocks.0.up.base.weight'" in message or "'up.base.weight'" in message, message
        assert "quant_state is None" in message


def test_bnb_refuses_a_dropped_absmax_naming_every_weight(runs: list[dict[str, Any]]) -> None:
    """The first forward's check refuses on every rank and names each weight whose absmax was dropped."""
    for out in runs:
        message = out["refused"]
        assert message is not None, "the pre-step check let weights with replaced absmax state through"
        for name in br.FORMATS:
            assert f"'{name}'" in message, (name, message)
        assert "absmax" in message
        assert "before the first step" in message


def test_bnb_refuses_a_weight_replaced_after_wrapping_on_one_rank(runs: list[dict[str, Any]]) -> None:
    """Every rank refuses (none hangs), naming the weight and the rank whose module lost the Params4bit."""
    for out in runs:
        message = out["replaced"]
        assert message is not None
        assert "'blocks.1.up.base.weight'" in message
        assert "(rank 1)" in message
        assert "no longer a Params4bit" in message or "holds another tensor" in message
        assert "blocks.0" not in message


def test_bnb_refuses_a_quant_state_dropped_after_wrapping_on_one_rank(runs: list[dict[str, Any]]) -> None:
    """A shard whose quant_state is set to None after wrapping, on rank 2: every rank refuses, naming it."""
    for out in runs:
        message = out["dropped_after_wrap"]
        assert message is not None
        assert "'blocks.0.down.weight' (this rank's shard): its quant_state is None" in message, message
        assert "(rank 2)" in message
        assert "blocks.1" not in message


def test_bnb_shards_hold_a_quarter_of_the_four_bit_bytes(runs: list[dict[str, Any]]) -> None:
    """At W=4 a rank holds 1/4 of the 4-bit bytes (by the format's formula), nothing gathered between steps.

    Every weight divides into whole groups evenly over 4 ranks, so the only slack is each component's
    16-byte alignment. Between steps each module holds a Params4bit (its piece, with its own QuantState),
    and no 4-bit state enters the state dict.
    """
    total = runs[0]["four_bit_bytes"]
    slack = len(br.FORMATS) * 3 * 16
    for rank, out in enumerate(runs):
        held = out["memory"]["quantized"]
        assert total / 4 <= held <= total / 4 + slack, (rank, held, total)
        assert out["memory"]["unsharded"] == 0
        assert set(out["shard_types"].values()) == {"Params4bit"}
        assert out["owner_states"] == ["NoneType"] * len(br.FORMATS)  # no Linear4bit keeps the whole state
        assert not [k for k in out["state_dict_keys"] if "base.weight" in k or "down.weight" in k]


def test_bnb_hf_llama_loaded_in_4_bits_with_peft_trains_alike_sharded(runs: list[dict[str, Any]]) -> None:
    """A tiny Llama from transformers' BitsAndBytesConfig (nf4, double quantization) with PEFT LoRA adapters.

    Losses over 4 AdamW steps at W=2 and W=4 equal the one-process run's; at W=4 a rank holds a quarter
    of its 4-bit bytes (codes, absmax codes, nested absmax; plus each component's 16-byte alignment).
    """
    for out in runs:
        hf = out["hf"]
        assert "Params4bit" in hf["kinds"]
        for world in (2, 4):
            assert_trajectories(hf[f"run{world}"], hf["reference"], f"W={world} 4-bit Llama + PEFT")
        assert hf["reference"][-1] < hf["reference"][0]
        total, weights = hf["four_bit"]
        assert weights == 14  # 7 projections per decoder layer
        assert total / 4 <= hf["quantized"] <= total / 4 + weights * 3 * 16, (hf["quantized"], total)
