"""Callbacks injected through the config (+callbacks.NAME._target_=...) that record what a run ended with."""

from __future__ import annotations

import json
from typing import Any


class RecordUseCache:
    """At the end of the fit, write each rank's ``model.config.use_cache`` to ``use_cache.rankN.json``."""

    def on_fit_end(self, trainer: Any, summary: Any) -> None:
        value = getattr(getattr(trainer.model, "config", None), "use_cache", "no config")
        path = trainer.run_dir / f"use_cache.rank{trainer.info.rank}.json"
        path.write_text(json.dumps({"use_cache": value}))
