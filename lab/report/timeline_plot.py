"""The run's timeline as a PNG: world size, step and loss over time, with every fault marked.

It draws only what ``report.json`` says, so the plot and the report cannot disagree (a test
reads each mark back off the figure): per fault a dashed line at the injection, a dotted one
at the first reaction (detection) and a solid one at the round that trained (resume), and
shading over the stretches in which no optimiser step ran (``paused``), not over the whole
fault: during a join the old group trains on while the new node boots.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on a build agent

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from lab.report.node_logs import Record  # noqa: E402

MARKS = (
    ("injected_at", "tab:red", "--"),
    ("detected_at", "tab:orange", ":"),
    ("resumed_at", "tab:green", "-"),
)


def timeline_figure(records: list[Record], report: dict[str, Any]) -> Figure:
    """The figure; each fault's marks carry a gid such as ``resumed_at-2`` or ``paused-2-0``."""
    start = report["start_ts"]
    metrics = [r for r in records if r["kind"] == "metrics"]
    times = [r["ts"] - start for r in metrics]
    fig, (world_ax, step_ax, loss_ax) = plt.subplots(3, 1, sharex=True, figsize=(11, 7.5))
    world_ax.step(times, [r["world_size"] for r in metrics], where="post", color="tab:blue")
    world_ax.set_ylabel("world size")
    world_ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    world_ax.set_ylim(0, max([r["world_size"] for r in metrics], default=1) + 1)
    step_ax.plot(times, [r["step"] for r in metrics], ".", markersize=2, color="tab:green")
    step_ax.set_ylabel("step")
    losses = [
        (t, r["loss"]) for t, r in zip(times, metrics, strict=True) if r.get("loss") is not None
    ]
    loss_ax.plot([t for t, _ in losses], [v for _, v in losses], color="tab:purple", linewidth=1)
    loss_ax.set_ylabel("loss")
    loss_ax.set_xlabel("seconds since start")
    for fault in report["faults"]:
        index = fault["index"]
        for ax in (world_ax, step_ax, loss_ax):
            for key, color, style in MARKS:
                if fault.get(key) is not None:
                    x = fault[key] - start
                    ax.axvline(x, color=color, linestyle=style, linewidth=1, gid=f"{key}-{index}")
            for n, (begin, end) in enumerate(fault.get("paused", [])):
                gid = f"paused-{index}-{n}"
                ax.axvspan(begin - start, end - start, color="tab:red", alpha=0.15, gid=gid)
        world_ax.annotate(
            fault["kind"],
            (fault["injected_at"] - start, world_ax.get_ylim()[1]),
            rotation=90,
            va="top",
            ha="right",
            fontsize=8,
        )
    run = report["run"]
    fig.suptitle(
        f"step {run['final_step']}/{run['max_steps']}, {run['faults_recovered']}/"
        f"{run['faults_planned']} faults recovered, {run['total_paused_s']:.1f} s without a "
        f"step, {run['total_downtime_s']:.1f} s to full size\n"
        "dashed: fault  dotted: detected  solid: resumed  shaded: no step ran"
    )
    fig.tight_layout()
    return fig


def plot_timeline(records: list[Record], report: dict[str, Any], path: Path) -> Path:
    """Write the timeline plot to ``path`` and return it."""
    fig = timeline_figure(records, report)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
