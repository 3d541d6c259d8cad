"""The planner's output: a table of ranked configurations and an optional chart of their time split."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from shardline.diagnostics.plan.cost import Cluster, Prediction
from shardline.errors import ConfigurationError

__all__ = ["plot_predictions", "table_rows"]

HEADER = ("#", "configuration", "step s", "tokens/s/GPU", "MFU", "peak GiB", "compute", "recompute", "exposed comm",
          "optimizer", "engine memory")  # fmt: skip


def table_rows(predictions: Sequence[Prediction]) -> list[tuple[str, ...]]:
    """One row of :data:`HEADER` per prediction, in order."""
    return [
        (
            str(i),
            p.candidate.label + ("" if p.fits else " (does not fit)"),
            f"{p.step_time_s:.3f}",
            f"{p.tokens_per_s_per_gpu:,.0f}",
            f"{p.mfu:.1%}",
            f"{p.peak_memory_gib:.1f}",
            f"{p.compute_s:.3f}",
            f"{p.recompute_s:.3f}",
            f"{p.exposed_comm_s:.3f}",
            f"{p.optimizer_s:.3f}",
            f"{p.engine_memory_s:.3f}",
        )
        for i, p in enumerate(predictions, 1)
    ]


def plot_predictions(predictions: Sequence[Prediction], *, cluster: Cluster, title: str, path: str | Path) -> None:
    """A horizontal bar per configuration: its step time split into compute, recompute, exposed comm, optimizer
    and the engine's memory work."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigurationError(
            "--plot needs matplotlib, which is not installed: pip install 'shardline[plot]', or leave out --plot"
        ) from None
    labels = [p.candidate.label for p in predictions][::-1]
    parts = (("compute", "compute_s"), ("recompute", "recompute_s"), ("exposed comm", "exposed_comm_s"),
             ("optimizer", "optimizer_s"), ("engine memory", "engine_memory_s"))  # fmt: skip
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(labels) + 1.5))
    left = [0.0] * len(labels)
    for name, attr in parts:
        values = [getattr(p, attr) for p in predictions][::-1]
        ax.barh(labels, values, left=left, label=name)
        left = [a + b for a, b in zip(left, values, strict=True)]
    ax.set_xlabel("predicted step time, s")
    ax.set_title(f"{title}\n{cluster.nodes} x {cluster.gpus_per_node} {cluster.device.name}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
