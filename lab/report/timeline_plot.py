"""The run's timeline as a PNG: world size, step and loss over time, with every fault marked.

It draws only what ``report.json`` says, so the plot and the report cannot disagree (a test
reads each mark back off the figure): per fault a dashed line at the injection, a dotted one
at the first reaction (detection) and a solid one at the round that trained (resume), and
shading over the stretches in which no optimiser step ran (``paused``), not over the whole
fault: during a join the old group trains on while the new node boots. The loss line breaks
across those stretches: a line drawn across them would show training that did not happen.
Each fault's number stands above its dashed line, and a key under the panels gives each
number's fault in full.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib

from training.records import METRICS

matplotlib.use("Agg")  # files only: no display on a build agent

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from training.records import Record  # noqa: E402

MARKS = (
    ("injected_at", "tab:red", "--"),
    ("detected_at", "tab:orange", ":"),
    ("resumed_at", "tab:green", "-"),
)
KEY_LINE_CHARS = 120
"""The fault key wraps after this many characters (the figure is 11 inches wide)."""
KEY_LINE_INCHES = 0.14
"""One line of the key at 8 points; the figure grows by the key's height."""
# Two fault numbers closer than this (a fraction of the time axis) go on different rows.
LABEL_MIN_GAP = 0.025


def loss_line(
    points: list[tuple[float, float]], pauses: list[tuple[float, float]]
) -> tuple[list[float], list[float]]:
    """The loss line's x and y: a NaN (where matplotlib breaks a line) between two points
    with a stretch in which no step ran between them."""
    xs: list[float] = []
    ys: list[float] = []
    for n, (t, loss) in enumerate(sorted(points)):
        if n and any(begin < t and end > xs[-1] for begin, end in pauses):
            xs.append(math.nan)
            ys.append(math.nan)
        xs.append(t)
        ys.append(loss)
    return xs, ys


def fault_key(faults: list[dict[str, Any]]) -> list[str]:
    """``0: evict node-2 @ step 20   1: join a new node @ step 40 ...``, wrapped in lines."""
    lines: list[str] = []
    for fault in faults:
        entry = f"{fault['index']}: {fault.get('description') or fault['kind']}"
        if lines and len(lines[-1]) + 3 + len(entry) <= KEY_LINE_CHARS:
            lines[-1] += "   " + entry
        else:
            lines.append(entry)
    return lines


def _label_rows(xs: list[float], span: float) -> list[int]:
    """A row for each fault number, so that numbers close in time do not overlap."""
    rows: list[int] = []
    last_x: dict[int, float] = {}
    for x in xs:
        row = next(
            (r for r in range(len(xs)) if x - last_x.get(r, -math.inf) >= LABEL_MIN_GAP * span),
            0,
        )
        rows.append(row)
        last_x[row] = x
    return rows


def _mark_faults(fig: Figure, axes: list[Any], report: dict[str, Any]) -> None:
    start = report["start_ts"]
    world_ax = axes[0]
    for fault in report["faults"]:
        index = fault["index"]
        for ax in axes:
            for key, color, style in MARKS:
                if fault.get(key) is not None:
                    x = fault[key] - start
                    ax.axvline(x, color=color, linestyle=style, linewidth=1, gid=f"{key}-{index}")
            for n, (begin, end) in enumerate(fault.get("paused", [])):
                gid = f"paused-{index}-{n}"
                ax.axvspan(begin - start, end - start, color="tab:red", alpha=0.15, gid=gid)
    xs = [f["injected_at"] - start for f in report["faults"]]
    low, high = world_ax.get_xlim()
    for fault, x, row in zip(report["faults"], xs, _label_rows(xs, high - low), strict=True):
        world_ax.annotate(
            str(fault["index"]),
            (x, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(0, 2 + 10 * row),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=8,
            color="tab:red",
            annotation_clip=False,  # drawn even when the injection is past the last line
            gid=f"label-{fault['index']}",
        )


def timeline_figure(records: list[Record], report: dict[str, Any]) -> Figure:
    """The figure; each fault's marks carry a gid such as ``resumed_at-2`` or ``paused-2-0``."""
    start = report["start_ts"]
    metrics = sorted((r for r in records if r["kind"] == METRICS), key=lambda r: r["ts"])
    times = [r["ts"] - start for r in metrics]
    key = fault_key(report["faults"])
    key_height = KEY_LINE_INCHES * len(key) + 0.15 if key else 0.0
    fig, axes = plt.subplots(3, 1, sharex=True, figsize=(11, 7.5 + key_height))
    world_ax, step_ax, loss_ax = axes
    world_ax.step(times, [r["world_size"] for r in metrics], where="post", color="tab:blue")
    world_ax.set_ylabel("world size")
    world_ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    world_ax.set_ylim(0, max([r["world_size"] for r in metrics], default=1) + 1)
    step_ax.plot(times, [r["step"] for r in metrics], ".", markersize=2, color="tab:green")
    step_ax.set_ylabel("step")
    losses = [
        (t, r["loss"]) for t, r in zip(times, metrics, strict=True) if r.get("loss") is not None
    ]
    pauses = [
        (begin - start, end - start) for f in report["faults"] for begin, end in f.get("paused", [])
    ]
    loss_ax.plot(*loss_line(losses, pauses), color="tab:purple", linewidth=1, gid="loss")
    loss_ax.set_ylabel("loss")
    loss_ax.set_xlabel("seconds since start")
    _mark_faults(fig, list(axes), report)
    run = report["run"]
    fig.suptitle(
        f"step {run['final_step']}/{run['max_steps']}, {run['faults_recovered']}/"
        f"{run['faults_planned']} faults recovered, {run['total_paused_s']:.1f} s without a "
        f"step, {run['total_downtime_s']:.1f} s to full size\n"
        "dashed: fault  dotted: detected  solid: resumed  shaded: no step ran"
    )
    bottom = key_height / fig.get_figheight()
    if key:
        fig.text(0.01, 0.01, "\n".join(key), fontsize=8, va="bottom", ha="left", gid="fault-key")
    fig.tight_layout(rect=(0, bottom, 1, 1))
    return fig


def plot_timeline(records: list[Record], report: dict[str, Any], path: Path) -> Path:
    """Write the timeline plot to ``path`` and return it."""
    fig = timeline_figure(records, report)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
