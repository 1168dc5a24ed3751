"""The timeline plot: the loss line breaks where no step ran, and every fault's label is
drawn in full, inside the figure and clear of the others."""

from __future__ import annotations

import math

import matplotlib.pyplot as plt
import pytest
from matplotlib.figure import Figure
from matplotlib.text import Text

from lab.report.outcomes import build_report
from lab.report.timeline_plot import fault_key, loss_line, timeline_figure
from tests.support.report_records import START, _kill_story, event, injection, metrics
from training.records import RESUMED


def _segments(xs: list[float]) -> list[tuple[float, float]]:
    """(first x, last x) of each piece of a line that NaNs break."""
    pieces: list[list[float]] = [[]]
    for x in xs:
        if math.isnan(x):
            pieces.append([])
        else:
            pieces[-1].append(x)
    return [(p[0], p[-1]) for p in pieces if p]


def test_the_loss_line_breaks_across_a_stretch_without_steps_and_only_there() -> None:
    points = [(float(t), 1.0) for t in (1, 2, 3, 10, 11, 20, 21)]
    xs, ys = loss_line(points, [(3.5, 10.0), (11.0, 19.0)])
    assert _segments(xs) == [(1, 3), (10, 11), (20, 21)]
    assert [math.isnan(x) for x in xs] == [math.isnan(y) for y in ys]
    assert loss_line(points, []) == ([p[0] for p in points], [1.0] * len(points))


def test_the_plotted_loss_breaks_at_the_reports_pause() -> None:
    records = _kill_story()
    report = build_report(
        records,
        [injection(0, 12.5, "kill", 2)],
        start_ts=START,
        global_batch_size=32,
        max_steps=20,
        planned_faults=1,
    )
    fig = timeline_figure(records, report)
    try:
        (loss,) = [line for line in fig.axes[2].lines if line.get_gid() == "loss"]
        segments = _segments(list(loss.get_xdata()))
        ((begin, end),) = report["faults"][0]["paused"]
        assert len(segments) == 2
        assert segments[0][1] <= begin - START and segments[1][0] >= end - START
    finally:
        plt.close(fig)


def _crowded_report() -> tuple[list[dict], dict]:
    """Seven faults, three of them within a second, the last after the last line."""
    records = [metrics(1.0 + 0.5 * i, i, 3) for i in range(1, 120)]
    times = [5.0, 5.3, 5.6, 20.0, 35.0, 50.0, 61.0]
    kinds = ["evict", "join", "kill", "freeze", "join", "etcd-restart", "kill-all"]
    injections = [injection(i, t, k, 3) for i, (t, k) in enumerate(zip(times, kinds, strict=True))]
    for inj in injections:
        inj["description"] = (
            f"{inj['kind']} with a long description to show in full #{inj['index']}"
        )
    records.append(event(0.5, RESUMED, step=0, source="fresh", world_size=3))
    report = build_report(
        sorted(records, key=lambda r: r["ts"]),
        injections,
        start_ts=START,
        global_batch_size=32,
        max_steps=120,
        planned_faults=7,
    )
    return records, report


def _texts(fig: Figure, prefix: str) -> list[Text]:
    return [t for t in fig.findobj(Text) if (t.get_gid() or "").startswith(prefix)]


def test_every_fault_label_is_drawn_in_full_inside_the_figure() -> None:
    records, report = _crowded_report()
    fig = timeline_figure(records, report)
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        figure_box = fig.bbox
        labels = _texts(fig, "label-")
        assert sorted(t.get_text() for t in labels) == [str(i) for i in range(7)]
        (key,) = _texts(fig, "fault-key")
        boxes = [t.get_window_extent(renderer) for t in [*labels, key]]
        for box in boxes:
            assert figure_box.x0 <= box.x0 and box.x1 <= figure_box.x1, box
            assert figure_box.y0 <= box.y0 and box.y1 <= figure_box.y1, box
        for n, box in enumerate(boxes):
            assert not any(box.overlaps(other) for other in boxes[n + 1 :]), box
        for fault in report["faults"]:
            assert f"{fault['index']}: {fault['description']}" in key.get_text()
        # Nothing of the key is under the panels.
        lowest_axis = min(ax.get_tightbbox(renderer).y0 for ax in fig.axes)
        assert key.get_window_extent(renderer).y1 < lowest_axis
    finally:
        plt.close(fig)


@pytest.mark.parametrize("count", [0, 1, 12])
def test_the_key_wraps_and_keeps_every_fault(count: int) -> None:
    faults = [
        {"index": i, "kind": "kill", "description": f"kill node-{i} @ step {i}"}
        for i in range(count)
    ]
    lines = fault_key(faults)
    assert all(len(line) <= 120 for line in lines)
    entries = [entry for line in lines for entry in line.split("   ")]
    assert entries == [f"{i}: kill node-{i} @ step {i}" for i in range(count)]
