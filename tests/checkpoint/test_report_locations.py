"""The report's collection builds each checkpoint's location once, not once per reader of its rows."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import pytest
from benchmarks.scale_ledger import _Run

from shardline.checkpoint.storage import stores
from shardline.report.collect import collect_run


def test_each_checkpoint_name_is_located_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = _Run(tmp_path, world=2, files=1, keep_last=2)
    for n in range(1, 7):  # 6 commit rows, 4 tombstones; 2 checkpoints still on disk
        run.save(n * 100, retention=False)
    located: collections.Counter[str] = collections.Counter()
    real = stores.as_location  # every location built from a name passes here (``stores.locate``)

    def counted(where: Any, **kwargs: Any) -> Any:
        located[str(where)] += 1
        return real(where, **kwargs)

    monkeypatch.setattr(stores, "as_location", counted)
    facts = collect_run(tmp_path)
    assert facts.lineage is not None
    assert facts.lineage.ok, facts.lineage
    assert len(facts.checkpoints) == 6
    names = {f"checkpoints/step-{n * 100}" for n in range(1, 7)}
    assert names <= located.keys(), located
    assert max(located[name] for name in names) == 1, located  # before: 3 (the chain check, statements, facts)
