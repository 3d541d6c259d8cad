"""A self-contained HTML report of a training run for reviewers (``shardline report RUN_DIR``)."""

from shardline.report.collect import CheckpointFacts, RunFacts, collect_run
from shardline.report.html import REPORT_FILE, render_report, write_report

__all__ = ["REPORT_FILE", "CheckpointFacts", "RunFacts", "collect_run", "render_report", "write_report"]
