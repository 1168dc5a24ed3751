"""The run's timeline as a PNG: world size and step over time, with the faults marked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on a build agent

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from lab.node_logs import Record  # noqa: E402


def plot_timeline(records: list[Record], report: dict[str, Any], path: Path) -> Path:
    """Write the timeline plot to ``path`` and return it."""
    start = report["start_ts"]
    metrics = [r for r in records if r["kind"] == "metrics"]
    times = [r["ts"] - start for r in metrics]
    fig, (world_ax, step_ax) = plt.subplots(2, 1, sharex=True, figsize=(11, 6))
    world_ax.step(times, [r["world_size"] for r in metrics], where="post", color="tab:blue")
    world_ax.set_ylabel("world size")
    world_ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    world_ax.set_ylim(0, max([r["world_size"] for r in metrics], default=1) + 1)
    step_ax.plot(times, [r["step"] for r in metrics], ".", markersize=2, color="tab:green")
    step_ax.set_ylabel("step")
    step_ax.set_xlabel("seconds since start")
    for fault in report["faults"]:
        injected = fault["injected_at"] - start
        for ax in (world_ax, step_ax):
            ax.axvline(injected, color="tab:red", linestyle="--", linewidth=1)
            if fault["recovered_at"] is not None:
                ax.axvspan(injected, fault["recovered_at"] - start, color="tab:red", alpha=0.12)
        world_ax.annotate(
            fault["kind"],
            (injected, world_ax.get_ylim()[1]),
            rotation=90,
            va="top",
            ha="right",
            fontsize=8,
        )
    run = report["run"]
    fig.suptitle(
        f"step {run['final_step']}/{run['max_steps']}, {run['faults_recovered']}/"
        f"{run['faults_planned']} faults recovered, {run['total_downtime_s']:.1f} s down"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
