"""The suite's tolerance helpers (tests/numerics.py) say what they claim: torch's own defaults, Higham's bound."""

from __future__ import annotations

import pytest
import torch

from tests.numerics import ASSERT_CLOSE_DEFAULTS, Reorder, close_ratio, condition, gamma, scale_ratio, unit_roundoff


@pytest.mark.parametrize("dtype", list(ASSERT_CLOSE_DEFAULTS))
def test_close_ratio_agrees_with_assert_close(dtype: torch.dtype) -> None:
    """Ratio <= 1 exactly when torch.testing.assert_close (its defaults) passes, on both sides of the edge."""
    rtol, atol = ASSERT_CLOSE_DEFAULTS[dtype]
    expected = torch.tensor([0.0, 1.0, -3.0, 100.0], dtype=torch.float64)
    for factor, close in ((0.5, True), (2.0, False)):
        actual = (expected + factor * (atol + rtol * expected.abs())).to(dtype)
        reference = expected.to(dtype)
        assert (close_ratio(actual, reference) <= 1) is close, (dtype, factor)
        if close:
            torch.testing.assert_close(actual, reference)
        else:
            with pytest.raises(AssertionError):
                torch.testing.assert_close(actual, reference)
    assert close_ratio(torch.tensor([float("nan")]), torch.tensor([0.0])) == float("inf")


def test_unit_roundoff_and_gamma() -> None:
    assert unit_roundoff(torch.float32) == 2.0**-24
    assert unit_roundoff(torch.bfloat16) == 2.0**-8
    assert gamma(10, torch.float32) == pytest.approx(10 * 2.0**-24, rel=1e-6)
    with pytest.raises(ValueError, match="unbounded"):
        gamma(300, torch.bfloat16)  # 300 * 2**-8 > 1: no a priori bound


def test_reordered_sums_stay_within_the_bound() -> None:
    """Many orders of the same fp32 sum, against the exact (fp64) sum: within gamma(n-1) * sum|x|, and they differ."""
    g = torch.Generator().manual_seed(0)
    n = 512
    values = torch.randn(n, generator=g, dtype=torch.float64).to(torch.float32)
    exact = values.double().sum().item()
    scale = values.double().abs().sum().item()
    sums = set()
    for _ in range(50):
        total = torch.zeros((), dtype=torch.float32)
        for v in values[torch.randperm(n, generator=g)]:
            total += v  # one rounding per term, sequentially
        sums.add(total.item())
        assert abs(total.item() - exact) <= gamma(n - 1, torch.float32) * scale
    assert len(sums) > 1, "the orders must actually round differently, or this shows nothing"
    # Two orders differ by at most twice that; Reorder states it relative to the result's magnitude.
    spread = (max(sums) - min(sums)) / abs(exact)
    cond = condition(list(values.double().unsqueeze(1)))
    assert cond == pytest.approx(scale / abs(exact))
    assert spread <= Reorder(n - 1, condition=cond).bound


def test_scale_ratio_measures_against_the_tensors_largest_element() -> None:
    expected = torch.tensor([0.0, 1.0])
    rtol, atol = ASSERT_CLOSE_DEFAULTS[torch.bfloat16]
    off = torch.tensor([0.5 * (atol + rtol), 1.0])  # far off for the zero element itself, close at the scale of 1
    assert close_ratio(off, expected, torch.bfloat16) > 1
    assert scale_ratio(off, expected, torch.bfloat16) == pytest.approx(0.5)
