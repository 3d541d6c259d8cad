"""A crash at every point of the commit protocol leaves a chain the next run resumes without ``--new-chain``.

For each scenario (``crash_scenarios.py``) a child process first traces the crash points it
passes; then, for every point and every time it is reached, a fresh copy of the scenario's run
directory is crashed there (``os._exit`` in a child, armed through
:mod:`shardline.checkpoint.faults.crashpoints`), and the next run is checked: it opens without
``--new-chain`` (except before a new chain's own commit point, where the user runs it again),
resumes the newest committed step (nothing lost but the step being saved, nothing moved aside
that was not damaged), ``shardline lineage`` verifies with no problem, ``latest`` verifies, and
the next save chains to what was resumed, and the resumed model and optimizer are bit for bit the
ones saved. The save and the quarantine run twice: per tensor, and with every checkpoint in the
packed layout (the model under shardline's engine in a one-rank group, its table non-empty). The
test fails if a listed point is reached by no scenario.

Children are forked from a forkserver that has imported torch and shardline once, so each
costs a fork, not an interpreter start.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import pytest

from shardline.checkpoint.faults.crashpoints import CRASH_EXIT_CODE, CRASH_POINTS
from tests.checkpoint import crash_scenarios as sc


def _trace(name: str, base: Path, work: Path) -> list[str]:
    root, trace_file = work / f"{name}-trace", work / f"{name}-trace.json"
    sc.copy_base(base, root)
    code = sc.run_child(name, root, None, trace_file=trace_file)
    assert code == 0, f"{name}: the traced run exited with {code}"
    sc.recover(name, root, may_redo_new_chain=False)  # the uninterrupted run leaves a healthy chain too
    return json.loads(trace_file.read_text())


# Over a hundred child processes, each ended by its crash or by its own 60 s deadline: a loaded
# machine stretches the campaign past the suite's 120 s backstop without anything hanging.
@pytest.mark.timeout(300)
def test_every_crash_point_is_survived(tmp_path: Path) -> None:
    started = time.monotonic()
    covered: dict[str, list[str]] = {}
    cases = 0
    spent: dict[str, str] = {}
    try:
        for scenario in sc.SCENARIOS:
            begun, before = time.monotonic(), cases
            base = tmp_path / "base" / scenario.name
            sc.prepare(scenario.name, base)
            order = _trace(scenario.name, base, tmp_path)
            swapped = order.index("new_chain.swapped") if "new_chain.swapped" in order else -1
            seen: Counter[str] = Counter()
            for index, point in enumerate(order):
                seen[point] += 1
                hit = seen[point]
                root = tmp_path / "case" / f"{scenario.name}-{point}-{hit}"
                sc.copy_base(base, root)
                code = sc.run_child(scenario.name, root, point, hit)
                assert code == CRASH_EXIT_CODE, f"{scenario.name}: crash at {point} (hit {hit}) exited with {code}"
                sc.recover(scenario.name, root, may_redo_new_chain=index < swapped)
                covered.setdefault(point, []).append(f"{scenario.name}#{hit}")
                cases += 1
            spent[scenario.name] = f"{cases - before} in {time.monotonic() - begun:.1f} s"
    finally:
        sc.end_group()  # the packed scenarios' one-rank group in this process
    print(f"\ncrash points covered ({cases} crashes in {time.monotonic() - started:.1f} s: {spent}):")
    for point in CRASH_POINTS:
        elsewhere = ["in test_object_store_lifecycle.py"] if point in sc.STORE_POINTS else ["NOT COVERED"]
        print(f"  {point:<30} {', '.join(covered.get(point, elsewhere))}")
    missing = [p for p in CRASH_POINTS if p not in covered and p not in sc.STORE_POINTS]
    assert not missing, f"crash points no scenario reaches (add a scenario): {missing}"


def test_crash_points_are_armed_by_name_only() -> None:
    from shardline.checkpoint.faults import crashpoints

    with pytest.raises(ValueError, match=r"unknown crash point 'save\.nowhere'"):
        crashpoints.arm("save.nowhere")
    with pytest.raises(ValueError, match="hit counts from 1"):
        crashpoints.arm("save.renamed", hit=0)
    crashpoints.trace()
    try:
        with pytest.raises(ValueError, match="add it to"):
            crashpoints.crash_point("save.unlisted")
    finally:
        crashpoints.disarm()
