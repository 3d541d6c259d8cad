"""bitsandbytes Params4bit split into whole quantization groups and rebuilt (engine/bnb4.py), one process."""

from __future__ import annotations

import itertools

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")
from bitsandbytes.functional import dequantize_4bit  # noqa: E402

from shardline.engine.bnb4 import Params4bitFormat  # noqa: E402

VARIANTS = [("nf4", False), ("fp4", False), ("nf4", True), ("fp4", True)]


def _weight(quant_type: str, compress: bool) -> torch.nn.Parameter:
    torch.manual_seed(0)
    layer = bnb.nn.Linear4bit(512, 128, bias=False, quant_type=quant_type, compress_statistics=compress)
    weight: torch.nn.Parameter = layer.to("cpu").weight
    return weight


@pytest.mark.parametrize(("quant_type", "compress"), VARIANTS)
def test_every_piece_decodes_alone_and_the_pieces_rebuild_the_weight(quant_type: str, compress: bool) -> None:
    """Uneven pieces of whole groups each dequantize to their slice of the weight; joined, they are the weight."""
    weight = _weight(quant_type, compress)
    fmt = Params4bitFormat.of(weight)
    # 64-element blocks; with double quantization a group is 256 of them: 512 x 128 = 4 groups, else 1,024.
    assert fmt.group_numel == (64 * 256 if compress else 64)
    assert fmt.groups == 512 * 128 // fmt.group_numel
    full = dequantize_4bit(weight.data, weight.quant_state).reshape(-1)
    cuts = [0, fmt.groups // 4 + 1, fmt.groups - 1, fmt.groups]
    pieces = []
    for start, stop in itertools.pairwise(cuts):
        parts = fmt.parts(weight, start, stop - start)
        piece = fmt.build(parts, shape=((stop - start) * fmt.group_numel,))
        assert fmt.problems(piece, groups=stop - start) == []
        decoded = dequantize_4bit(piece.data, piece.quant_state).reshape(-1)
        assert torch.equal(decoded, full[start * fmt.group_numel : stop * fmt.group_numel])
        pieces.append(parts)
    joined = fmt.build(tuple(torch.cat(column) for column in zip(*pieces, strict=True)))
    assert type(joined).__name__ == "Params4bit"
    assert fmt.checksum(joined) == fmt.checksum(weight)
    assert torch.equal(
        dequantize_4bit(joined.data, joined.quant_state), dequantize_4bit(weight.data, weight.quant_state)
    )


def test_a_lost_or_altered_quant_state_is_named() -> None:
    """No quant_state: refused with the fix; a different blocksize or a plain tensor: listed as problems."""
    weight = _weight("nf4", True)
    fmt = Params4bitFormat.of(weight)
    state = weight.quant_state
    weight.quant_state = None
    with pytest.raises(ValueError, match=r"quant_state is None.*to\(device\)"):
        Params4bitFormat.of(weight)
    assert fmt.problems(weight, groups=fmt.groups) == ["its quant_state is None (the quantization state was lost)"]
    weight.quant_state = state
    state.blocksize = 128
    assert fmt.problems(weight, groups=fmt.groups) == ["its quant_state.blocksize is 128, was 64"]
    plain = torch.nn.Parameter(weight.data, requires_grad=False)
    assert fmt.problems(plain, groups=fmt.groups) == ["is a Parameter, no longer a Params4bit"]
