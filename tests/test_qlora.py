"""A 4-bit (NF4) frozen base with LoRA adapters, sharded: parity at W=1, 2, 4, memory, the pre-step check.

One launch of four ranks runs everything (tests/qlora_ranks.py): the plain model on the whole
batch (the reference), the same model sharded over process groups of 1, 2 and 4 ranks, and the
same model with a quantization state dropped while sharding.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from shardline.testing import run_distributed
from tests import qlora_ranks as qr
from tests.models import chain_terms
from tests.numerics import Reorder, assert_caught, assert_reordered, assert_trajectories, close_ratio, max_rel_err

pytest.importorskip("torchao")

pytestmark = [pytest.mark.slow, pytest.mark.numerics]


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return run_distributed(qr.parity, 4, timeout=110)


def _grad_rule(world: int) -> Reorder:
    # Longest chain behind an adapter gradient: per block a LoRA projection (DIM + RANK terms), the MLP's
    # up (DIM + RANK) and down (HIDDEN) projections; the head (DIM); over the batch's tokens and the ranks.
    forward = 2 * (2 * (qr.DIM + qr.RANK) + qr.HIDDEN) + qr.DIM
    return Reorder(chain_terms(forward=forward, tokens=qr.BATCH * qr.SEQ, world_size=world))


def _grad_errors(actual: dict[str, list[float]], expected: dict[str, list[float]]) -> dict[str, float]:
    assert sorted(actual) == sorted(expected), (sorted(actual), sorted(expected))
    return {k: max_rel_err(torch.tensor(actual[k]), torch.tensor(expected[k])) for k in expected}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_qlora_parity(runs: list[dict[str, Any]], world: int) -> None:
    """First-step adapter gradients within the reordering bound, losses over 4 AdamW steps equal, on every rank."""
    for out in runs:
        ref_losses, ref_grads = out["reference"]
        losses, grads = out[f"run{world}"]
        assert sorted(grads) == sorted(out["adapters"])
        assert len(grads) == 8
        assert_reordered(_grad_errors(grads, ref_grads), _grad_rule(world), f"W={world} adapter gradients")
        assert_trajectories(losses, ref_losses, f"W={world} QLoRA")
        assert losses[-1] < losses[0]  # it trains
        if world == 1:  # one rank runs the plain model's kernels on the same operands: bit for bit
            assert losses == ref_losses
            assert grads == ref_grads


def test_qlora_parity_sees_a_dropped_quantization_state(runs: list[dict[str, Any]]) -> None:
    """With the factors of each weight replaced while sharding (check skipped), the same comparisons fail."""
    for out in runs:
        ref_losses, ref_grads = out["reference"]
        losses, grads = out["faulty_run"]
        assert_caught(_grad_errors(grads, ref_grads), _grad_rule(4), "dropped quantization factors: gradients")
        ratios = {f"step {i}": close_ratio(a, e) for i, (a, e) in enumerate(zip(losses, ref_losses, strict=True))}
        assert_caught(ratios, None, "dropped quantization factors: losses")


def test_qlora_refuses_a_dropped_quantization_state_naming_the_weight(runs: list[dict[str, Any]]) -> None:
    """The first forward's check refuses on every rank and names each weight whose state was dropped."""
    for out in runs:
        message = out["refused"]
        assert message is not None, "the pre-step check let a weight with replaced quantization factors through"
        for name in qr.quantized_names():
            assert f"'{name}'" in message, (name, message)
        assert "quantization_factor" in message
        assert "before the first step" in message


def test_qlora_refuses_a_weight_replaced_after_wrapping_on_one_rank(runs: list[dict[str, Any]]) -> None:
    """Every rank refuses (none hangs), naming the weight and the rank whose module holds a plain tensor instead."""
    for out in runs:
        message = out["replaced"]
        assert message is not None
        assert "'blocks.1.up.base.weight'" in message
        assert "(rank 1)" in message
        assert "no longer an NF4Tensor" in message or "holds another tensor" in message
        assert "blocks.0" not in message


def test_qlora_shards_hold_a_quarter_of_the_four_bit_bytes(runs: list[dict[str, Any]]) -> None:
    """At W=4 a rank holds ~1/4 of the 4-bit bytes (by the format's formula) and nothing gathered between steps.

    Also: each NF4 weight registered between steps covers about a quarter of its elements (whole scaler
    groups), and a forward issues one uint8 all-gather per unit holding NF4 weights (the two blocks).
    """
    total = runs[0]["four_bit_bytes"]
    group_bytes = qr.BLOCK * qr.SCALER_BLOCK // 2 + qr.SCALER_BLOCK + 4  # one scaler group's codes+scalers+factor
    slack = 6 * (group_bytes + 3 * 16)  # per weight: one group of rounding up, three parts' alignment
    for rank, out in enumerate(runs):
        held = out["memory"]["quantized"]
        assert total / 4 <= held <= total / 4 + slack, (rank, held, total)
        assert held < total / 3
        assert out["memory"]["unsharded"] == 0
        for name, numel in out["shard_numels"].items():
            full = (qr.HIDDEN * qr.DIM) if ("up." in name or "down" in name) else qr.DIM * qr.DIM
            groups = full // (qr.BLOCK * qr.SCALER_BLOCK)
            chunk = math.ceil(groups / 4)
            assert numel == min(chunk, max(0, groups - rank * chunk)) * qr.BLOCK * qr.SCALER_BLOCK, (name, numel)
        assert out["uint8_gathers"] == 2


@pytest.mark.parametrize("world", [1, 2])
def test_qlora_offload_bit_identical(runs: list[dict[str, Any]], world: int) -> None:
    """NF4 + LoRA with CPUOffload: losses and first-step adapter gradients equal those without offload, bit for bit."""
    for out in runs:
        losses, grads = out[f"offload{world}"]
        plain_losses, plain_grads = out[f"run{world}"]
        assert losses == plain_losses, (world, losses, plain_losses)
        assert grads == plain_grads


def test_qlora_offload_keeps_the_four_bit_bytes_on_the_host(runs: list[dict[str, Any]]) -> None:
    """The 4-bit records are host memory (accounted in host_quantized, not device_total) and copied per gather."""
    total = runs[0]["four_bit_bytes"]
    group_bytes = qr.BLOCK * qr.SCALER_BLOCK // 2 + qr.SCALER_BLOCK + 4
    slack = 6 * (group_bytes + 3 * 16)  # per weight: one group of rounding up, three parts' alignment
    for world in (1, 2):
        for rank, out in enumerate(runs):
            m = out[f"offload{world}_memory"]
            assert m["record_devices"] == ["cpu"]
            assert total / world <= m["host_quantized"] <= total / world + slack, (world, rank, m, total)
            assert m["host_quantized"] == m["quantized"] == m["record_bytes"]
            assert m["host_params"] == m["sharded_params"] > 0  # the float shards are on the host too
            assert m["host_total"] >= m["host_params"] + m["host_quantized"]
            assert m["device_total"] == m["total"] - m["host_total"]
            assert m["device_total"] <= m["total"] - m["host_quantized"] - m["host_params"]
            # Each step gathers each unit's record at least once (and the pre-step check once more): all copied.
            assert m["h2d_bytes"] >= (qr.STEPS + 1) * m["record_bytes"] + m["host_params"], (world, rank, m)


def test_qlora_offload_parity_sees_a_dropped_copy_of_the_four_bit_shard(runs: list[dict[str, Any]]) -> None:
    """The 4-bit record's host -> device copy dropped (check skipped): W=2 losses and gradients differ from run2.

    With the check on, the first forward refuses: it gathers through the same copy.
    """
    for out in runs:
        losses, grads = out["offload_dropped"]
        ref_losses, ref_grads = out["run2"]
        assert_caught(_grad_errors(grads, ref_grads), _grad_rule(2), "dropped 4-bit copy: gradients")
        ratios = {f"step {i}": close_ratio(a, e) for i, (a, e) in enumerate(zip(losses, ref_losses, strict=True))}
        assert_caught(ratios, None, "dropped 4-bit copy: losses")
        message = out["offload_dropped_refused"]
        assert message is not None
        assert "before the first step" in message
        assert "'blocks.1.attn.base.weight'" in message  # block 1 gathered block 0's record
