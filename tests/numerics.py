"""How far two computations of the same numbers may differ: every tolerance of the suite, derived here.

The sharded engine and the one-process reference do the same arithmetic in another order: a rank
sums its slice of the batch, then the ranks' partial sums are averaged; torch also picks other
CPU kernels per instruction set (``ATEN_CPU_CAPABILITY=default|avx2|avx512``), which block their
dot products differently. The suite states each claim in one of three ways.

**Bit for bit** -- where both sides run the same kernels on the same operands in the same order
(one rank against the plain model, a resume at the same world size): ``torch.equal``, no tolerance.

**Reordered sums** (:class:`Reorder`) -- gradients and norms, compared one step after identical
parameters. Standard forward error analysis (N. J. Higham, *Accuracy and Stability of Numerical
Algorithms*, 2nd ed., SIAM 2002, section 4.2): a sum of ``n`` floating-point terms, in any order,
is within ``gamma(n - 1) * sum|x_i|`` of the exact sum, where ``gamma(k) = k*u / (1 - k*u)`` and
``u`` is the unit roundoff (``eps / 2``: 2**-24 for fp32, 2**-8 for bf16). Two results that
differ only in order are then within twice that of each other. A value reached through a chain
of reductions (a layer's dot products feeding the next, backward mirroring forward, then the
weight gradient's sum over the batch's tokens and across ranks) accumulates their lengths to
first order, so ``terms`` is the length of the longest such chain, counted from the model's
dimensions by the test (``tests.models.chain_terms``). Roundings of a narrower compute dtype
(bf16 activations and gradients) are counted apart (``low_terms``) with that dtype's ``u``.
Magnitudes: errors are measured relative to the largest element of the tensor compared
(:func:`max_rel_err`), which stands for ``sum|x_i|`` when the largest entries are not the result
of cancellation (condition 1) -- true of fp32 gradients, whose largest entries are the coherent
ones. Where one rounding is coarse (bf16) and the terms cancel, the test measures the
condition number of the sum, ``max sum|x_i| / max|sum x_i|`` (Higham, section 4.2), from the
ranks' partial gradients, and the bound scales by it (``condition``).

**Trajectories** (:func:`close_ratio`) -- losses and parameters after several optimizer steps.
Adam divides each gradient element by its own magnitude, so a rounding difference in a
near-zero element becomes an update difference of up to the learning rate: no bound follows from
``u`` alone. Those comparisons make the claim torch makes for its own numerics, the documented
defaults of :func:`torch.testing.assert_close` for the dtype compared (fp32: ``rtol=1.3e-6,
atol=1e-5``), element by element; for values computed in bf16, at the tensor's scale
(:func:`scale_ratio`). The sharp check of data parallelism is the gradient one above:
it alone sees a wrong gradient scale, to which Adam is blind.

Each bound must still catch a real bug: the parity tests also run with
:class:`shardline.testing.FaultyCollectives` (a missing gradient reduction, or a sum where the
mean belongs) and check that the same comparison fails (:func:`assert_caught`).

Set ``SHARDLINE_NUMERICS_LOG=path`` to append every comparison (what, error, bound, kernel set)
to ``path`` as JSON lines: the margins of the suite on this machine.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from shardline.engine import use_collectives
from shardline.testing import FaultyCollectives, GradientFault

# The documented defaults of torch.testing.assert_close, by dtype (its docs' table).
ASSERT_CLOSE_DEFAULTS: dict[torch.dtype, tuple[float, float]] = {
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float32: (1.3e-6, 1e-5),
    torch.float64: (1e-7, 1e-7),
}


def unit_roundoff(dtype: torch.dtype) -> float:
    """``u = eps / 2``: the largest relative error of rounding one real number to ``dtype``."""
    return torch.finfo(dtype).eps / 2


def gamma(n: int, dtype: torch.dtype) -> float:
    """Higham's ``gamma_n = n*u / (1 - n*u)``: the relative error bound of ``n`` successive roundings."""
    nu = n * unit_roundoff(dtype)
    if nu >= 1:
        raise ValueError(f"gamma({n}) for {dtype} is unbounded (n*u = {nu:.2f} >= 1): no a priori bound exists")
    return nu / (1 - nu)


@dataclass(frozen=True)
class Reorder:
    """Two computations of the same values whose roundings differ in order (see the module docstring).

    Attributes:
        terms: length of the longest chain of reductions in ``dtype`` whose order may differ.
        dtype: the accumulation dtype of those reductions.
        low_terms: roundings to ``low_dtype`` along that chain (values stored in a narrower dtype).
        low_dtype: the narrower compute dtype, if any.
        condition: ``max sum|x_i| / max|sum x_i|`` of the sums compared (1: no cancellation).
    """

    terms: int
    dtype: torch.dtype = torch.float32
    low_terms: int = 0
    low_dtype: torch.dtype | None = None
    condition: float = 1.0

    @property
    def bound(self) -> float:
        """The relative bound: twice ``gamma`` of each dtype's chain (each side is that far from exact)."""
        value = 2 * gamma(self.terms, self.dtype)
        if self.low_terms:
            if self.low_dtype is None:
                raise ValueError("low_terms needs low_dtype")
            value += 2 * gamma(self.low_terms, self.low_dtype)
        return value * self.condition

    def __str__(self) -> str:
        text = f"2*gamma({self.terms}, {str(self.dtype).removeprefix('torch.')})"
        if self.low_terms:
            text += f" + 2*gamma({self.low_terms}, {str(self.low_dtype).removeprefix('torch.')})"
        if self.condition != 1.0:
            text = f"({text}) * condition {self.condition:.2f}"
        return f"{text} = {self.bound:.2e}"


def max_rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``max|a - e| / max|e|`` (0 when both are empty; the absolute error when ``e`` is all zero)."""
    actual, expected = actual.double(), expected.double()
    if not expected.numel():
        return 0.0
    scale = expected.abs().max().item()
    diff = (actual - expected).abs().max().item()
    return diff / scale if scale else diff


def close_ratio(
    actual: torch.Tensor | float, expected: torch.Tensor | float, dtype: torch.dtype | None = None
) -> float:
    """``max |a - e| / (atol + rtol*|e|)`` with assert_close's defaults for ``dtype``: at most 1 means close.

    ``dtype`` defaults to the expected tensor's (fp32 for Python floats: the suite's losses are
    fp32 values read out with ``.item()``).
    """
    exp = expected if isinstance(expected, torch.Tensor) else torch.tensor(expected, dtype=torch.float32)
    act = actual if isinstance(actual, torch.Tensor) else torch.tensor(actual, dtype=torch.float32)
    rtol, atol = ASSERT_CLOSE_DEFAULTS[dtype or exp.dtype]
    if act.shape != exp.shape:
        raise AssertionError(f"shapes differ: {tuple(act.shape)} vs {tuple(exp.shape)}")
    if not exp.numel():
        return 0.0
    act, exp = act.double(), exp.double()
    if not bool(torch.isfinite(act).all()):
        return math.inf
    return ((act - exp).abs() / (atol + rtol * exp.abs())).max().item()


def scale_ratio(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> float:
    """``max|a - e| / (atol + rtol*max|e|)``: assert_close's defaults for ``dtype`` at the tensor's scale.

    For values computed in a narrow dtype (bf16 compute, fp32 storage): their rounding comes from
    sums at the scale of the whole tensor, so an element near zero (a bias that started at zero)
    carries an error relative to that scale, not to itself.
    """
    rtol, atol = ASSERT_CLOSE_DEFAULTS[dtype]
    if not expected.numel():
        return 0.0
    act, exp = actual.double(), expected.double()
    if not bool(torch.isfinite(act).all()):
        return math.inf
    return (act - exp).abs().max().item() / (atol + rtol * exp.abs().max().item())


def trajectory_ratio(
    actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor], *, skip: Sequence[str] = ()
) -> dict[str, float]:
    """:func:`close_ratio` of every entry of two state dicts (in each tensor's own dtype)."""
    if sorted(actual) != sorted(expected):
        raise AssertionError(f"keys differ: {sorted(set(actual) ^ set(expected))}")
    return {k: close_ratio(actual[k], expected[k]) for k in expected if k not in skip}


def _log(what: str, error: float, bound: float, rule: str) -> None:
    path = os.environ.get("SHARDLINE_NUMERICS_LOG")
    if not path:
        return
    row = {
        "what": what,
        "error": error,
        "bound": bound,
        "margin": (bound / error) if error else math.inf,
        "rule": rule,
        "kernels": torch.backends.cpu.get_cpu_capability(),
    }
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")


def _worst(errors: Mapping[str, float] | float) -> tuple[str, float]:
    if isinstance(errors, Mapping):
        if not errors:
            raise AssertionError("nothing was compared")
        key = max(errors, key=lambda k: errors[k])
        return key, errors[key]
    return "", float(errors)


def condition(partials: Sequence[torch.Tensor]) -> float:
    """``max sum_r |p_r| / max |sum_r p_r|``: how much the terms of a sum cancel (1 when they do not)."""
    total = torch.stack([p.double() for p in partials]).sum(0).abs().max().item()
    magnitude = torch.stack([p.double().abs() for p in partials]).sum(0).max().item()
    return magnitude / total if total else 1.0


def assert_reordered(
    errors: Mapping[str, float] | float,
    rule: Reorder,
    what: str,
    *,
    conditions: Mapping[str, float] | None = None,
) -> None:
    """Every relative error (:func:`max_rel_err`) is within ``rule``'s bound (scaled by its key's condition)."""
    if not isinstance(errors, Mapping):
        errors = {"": float(errors)}
    if not errors:
        raise AssertionError(f"{what}: nothing was compared")
    rules = {k: replace(rule, condition=conditions[k]) if conditions else rule for k in errors}
    key = max(errors, key=lambda k: errors[k] / rules[k].bound)
    worst, rule = errors[key], rules[key]
    _log(what, worst, rule.bound, str(rule))
    where = f"{what}: '{key}'" if key else what
    assert worst <= rule.bound, f"{where} off by {worst:.3e} relative, beyond the reordering bound {rule}"


def assert_trajectory(ratios: Mapping[str, float] | float, what: str) -> None:
    """Every :func:`close_ratio` is at most 1 (assert_close's defaults)."""
    key, worst = _worst(ratios)
    _log(what, worst, 1.0, "assert_close defaults")
    where = f"{what}: '{key}'" if key else what
    assert worst <= 1.0, f"{where} is {worst:.2f}x assert_close's default tolerance for its dtype"


def assert_trajectories(actual: Sequence[float], expected: Sequence[float], what: str) -> None:
    """Two fp32 loss curves agree step by step under assert_close's fp32 defaults."""
    assert len(actual) == len(expected), (actual, expected)
    ratios = {f"step {i}": close_ratio(a, e) for i, (a, e) in enumerate(zip(actual, expected, strict=True))}
    assert_trajectory(ratios, f"{what} loss")


def assert_caught(errors: Mapping[str, float] | float, rule: Reorder | None, what: str) -> None:
    """An injected fault makes the comparison fail: the worst error exceeds the bound by far.

    "By far": ten times the bound, so that the check's verdict does not hang on the bound's
    exact value. ``rule=None`` means a trajectory comparison (bound 1 on :func:`close_ratio`).
    """
    _, worst = _worst(errors)
    bound = 1.0 if rule is None else rule.bound
    _log(f"{what} (injected fault)", worst, bound, "fault must exceed 10x the bound")
    assert worst > 10 * bound, (
        f"{what}: an injected fault moved the result by only {worst:.3e} "
        f"(bound {bound:.2e}): this comparison cannot see that bug"
    )


def injecting(model: nn.Module, fault: GradientFault | str | None) -> contextlib.AbstractContextManager[Any]:
    """Run a step with ``fault`` injected into ``model``'s gradient reductions (nothing if None)."""
    return use_collectives(model, FaultyCollectives(fault)) if fault else contextlib.nullcontext()
