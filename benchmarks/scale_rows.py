"""The simulation's rows, one per W, for ``benchmarks/scale_sim.py``: the measurements, the costs extrapolated past
the largest W that measured them, each cost's log-log slope, and the ``--json`` file that holds them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

__all__ = ["SimulatedSave", "exponents", "extrapolate", "load_rows", "save_rows"]


@dataclasses.dataclass
class SimulatedSave:
    """One W's measurements (seconds, bytes, counts); ``scaled`` names the fields scaled from sampled tensors."""

    world: int
    files: int
    values: dict[str, float] = dataclasses.field(default_factory=dict)
    scaled: list[str] = dataclasses.field(default_factory=list)
    extrapolated: list[str] = dataclasses.field(default_factory=list)


def extrapolate(rows: list[SimulatedSave]) -> None:
    """Fill each row's ``extrapolated`` fields from the two largest W that measured them (their log-log slope)."""
    for row in rows:
        for key in row.extrapolated:
            have = [r for r in rows if key in r.values and r.world < row.world]
            if len(have) < 2:
                row.values[key] = float("nan")
                continue
            a, b = have[-2], have[-1]
            slope = math.log(b.values[key] / a.values[key]) / math.log(b.world / a.world)
            row.values[key] = b.values[key] * (row.world / b.world) ** slope


def exponents(rows: list[SimulatedSave]) -> dict[str, float]:
    """Each cost's log-log slope between the smallest and the largest W measured."""
    lo, hi = rows[0], rows[-1]
    out = {}
    for key, a in lo.values.items():
        if key in hi.extrapolated or key in lo.extrapolated:
            continue
        b = hi.values[key]
        if a > 0 and b > 0:
            out[key] = math.log(b / a) / math.log(hi.world / lo.world)
    return out


def load_rows(path: Path) -> list[SimulatedSave]:
    """The rows a ``--json`` file holds."""
    return [SimulatedSave(**row) for row in json.loads(path.read_text())["rows"]]


def save_rows(rows: list[SimulatedSave], path: Path) -> None:
    """Write ``rows`` as a ``--json`` file, with the machine's load average beside them."""
    data = {"load_average": os.getloadavg(), "rows": [dataclasses.asdict(r) for r in rows]}
    path.write_text(json.dumps(data, indent=1))
