"""The report, computed from synthetic node log records (no processes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from lab.report.outcomes import build_report, fault_outcome, groups_at_once, pause_after_s
from lab.report.text import format_table, format_world_sizes
from lab.report.timeline_plot import plot_timeline, timeline_figure
from tests.support.report_records import START, _kill_story, event, injection, metrics
from training.records import CHECKPOINT_SAVED, EMERGENCY_SAVE, EVALUATED, FINISHED, METRICS, RESUMED


def test_hard_loss_with_survivors() -> None:
    outcome = fault_outcome(
        _kill_story(), injection(0, 12.5, "kill", 2), float("-inf"), float("inf")
    )
    assert outcome["detected_at"] == pytest.approx(START + 12.6)
    assert outcome["detection_s"] == pytest.approx(0.1)
    assert outcome["resumed_at"] == pytest.approx(START + 18.0)
    assert outcome["recovered_at"] == pytest.approx(START + 19.5)  # first line after resumed
    assert outcome["downtime_s"] == pytest.approx(7.0)
    assert (outcome["world_size_before"], outcome["world_size_after"]) == (3, 2)
    assert (outcome["last_step_before"], outcome["resumed_step"], outcome["steps_lost"]) == (
        12,
        12,
        0,
    )
    assert outcome["resume_source"] == "local"
    assert outcome["recovered"] is True


def test_an_emergency_save_counts_as_progress_seen() -> None:
    """Logged every 5 steps, the save at step 13 is the last progress the logs show."""
    records = [
        metrics(1.0, 10, 2),
        event(2.0, EMERGENCY_SAVE, step=13, reason="sigterm"),
        event(5.0, RESUMED, step=13, source="local", world_size=1),
        metrics(6.0, 15, 1),
    ]
    outcome = fault_outcome(records, injection(0, 1.5, "evict", 1), float("-inf"), float("inf"))
    assert (outcome["last_step_before"], outcome["steps_lost"]) == (13, 0)


def test_full_restart_from_the_durable_checkpoint_loses_steps() -> None:
    records = [
        metrics(1.0, 45, 2),
        event(1.2, CHECKPOINT_SAVED, step=40),
        metrics(2.0, 47, 2),
        event(9.0, RESUMED, node="node-5", step=40, source="durable", world_size=2),
        metrics(10.0, 41, 2, node="node-5"),
    ]
    outcome = fault_outcome(records, injection(0, 2.5, "kill-all", 2), float("-inf"), float("inf"))
    assert outcome["detected_at"] is None  # nobody survived to notice
    assert (outcome["last_step_before"], outcome["resumed_step"], outcome["steps_lost"]) == (
        47,
        40,
        7,
    )
    assert outcome["resume_source"] == "durable"
    assert outcome["downtime_s"] == pytest.approx(7.5)


def test_a_fault_without_restart_recovers_at_the_next_line() -> None:
    records = [metrics(1.0, 5, 2), metrics(2.0, 6, 2), metrics(3.0, 7, 2)]
    outcome = fault_outcome(
        records, injection(0, 1.5, "etcd-restart", 2), float("-inf"), float("inf")
    )
    assert outcome["resumed_at"] is None and outcome["detected_at"] is None
    assert outcome["recovered_at"] == pytest.approx(START + 2.0)
    assert outcome["recovered"] is True


def test_recovery_at_the_wrong_world_size_is_not_recovered() -> None:
    records = [
        metrics(1.0, 5, 3),
        event(4.0, RESUMED, step=5, source="local", world_size=3),
        metrics(5.0, 6, 3),
    ]
    outcome = fault_outcome(records, injection(0, 2.0, "kill", 2), float("-inf"), float("inf"))
    assert outcome["world_size_after"] == 3
    assert outcome["recovered"] is False


def test_no_recovery_in_the_window() -> None:
    records = [metrics(1.0, 5, 3), metrics(30.0, 6, 2)]  # the line after the window's end
    outcome = fault_outcome(records, injection(0, 2.0, "freeze", 2), float("-inf"), START + 20.0)
    assert outcome["recovered_at"] is None and outcome["downtime_s"] is None
    assert outcome["recovered"] is False


def test_the_resumed_round_that_trained_counts_not_a_failed_one() -> None:
    records = [
        metrics(1.0, 5, 3),
        event(4.0, RESUMED, step=5, source="local", world_size=2),  # failed at once
        event(9.0, RESUMED, step=5, source="local", world_size=2),
        metrics(10.0, 6, 2),
    ]
    outcome = fault_outcome(records, injection(0, 2.0, "kill", 2), float("-inf"), float("inf"))
    assert outcome["resumed_at"] == pytest.approx(START + 9.0)


def test_build_report_windows_and_totals() -> None:
    records = _kill_story() + [event(27.0, FINISHED, node="node-1", step=20)]
    report = build_report(
        records,
        [injection(0, 12.5, "kill", 2)],
        start_ts=START,
        global_batch_size=32,
        max_steps=20,
        planned_faults=2,
    )
    run = report["run"]
    assert run["finished"] is True and run["final_step"] == 20
    assert run["wall_s"] == pytest.approx(27.0)
    assert run["samples_per_s"] == pytest.approx(20 * 32 / 27.0, abs=0.01)
    assert run["training_samples_per_s"] == pytest.approx(100.0)
    assert run["faults_injected"] == 1 and run["faults_recovered"] == 1
    assert run["all_recovered"] is False  # one of the two planned faults never ran
    assert run["total_downtime_s"] == pytest.approx(7.0)


def test_table_has_one_row_per_fault() -> None:
    report = build_report(
        _kill_story(),
        [injection(0, 12.5, "kill", 2)],
        start_ts=START,
        global_batch_size=32,
        max_steps=20,
        planned_faults=1,
    )
    table = format_table(report)
    row = next(line for line in table.splitlines() if "kill #0" in line)
    assert "3->2" in row and "local" in row and row.rstrip().endswith("yes")
    assert "1/1 faults recovered" in table


def test_plot_writes_a_png(tmp_path: Path) -> None:
    records = _kill_story()
    report = build_report(
        records,
        [injection(0, 12.5, "kill", 2)],
        start_ts=START,
        global_batch_size=32,
        max_steps=20,
        planned_faults=1,
    )
    path = plot_timeline(records, report, tmp_path / "plots" / "timeline.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 10_000


def _kill_all_with_a_round_of_one() -> list[dict]:
    """Two nodes at step 47; both killed at t=2.5; node-5 forms a round of one first, trains
    to step 43, then node-6 joins and the round of two resumes from node-5's save."""
    return [
        metrics(1.0, 45, 2),
        event(1.2, CHECKPOINT_SAVED, step=40),
        metrics(2.0, 47, 2),
        event(8.0, RESUMED, node="node-5", step=40, source="durable", world_size=1),
        metrics(9.0, 41, 1, node="node-5"),
        metrics(9.5, 42, 1, node="node-5"),
        metrics(10.0, 43, 1, node="node-5"),
        event(10.2, EMERGENCY_SAVE, node="node-5", step=43, reason="sigterm"),
        event(13.0, RESUMED, node="node-5", step=43, source="local", world_size=2),
        metrics(14.0, 44, 2, node="node-5"),
    ]


def test_recovery_is_the_first_line_at_the_planned_world_size() -> None:
    outcome = fault_outcome(
        _kill_all_with_a_round_of_one(),
        injection(0, 2.5, "kill-all", 2),
        float("-inf"),
        float("inf"),
    )
    assert outcome["recovered"] is True
    assert outcome["recovered_at"] == pytest.approx(START + 14.0)
    assert outcome["downtime_s"] == pytest.approx(11.5)
    assert outcome["world_size_after"] == 2
    # The round that trained at the planned size; the round of one is listed, not hidden.
    assert outcome["resumed_at"] == pytest.approx(START + 13.0)
    assert (outcome["resumed_step"], outcome["resume_source"]) == (43, "local")
    assert [(r["world_size"], r["step"], r["source"], r["trained"]) for r in outcome["rounds"]] == [
        (1, 40, "durable", True),
        (2, 43, "local", True),
    ]
    # 47 -> 40 at the first round, nothing at the second.
    assert (outcome["last_step_before"], outcome["steps_lost"]) == (47, 7)


def test_a_line_of_the_old_round_is_not_a_recovery_even_at_the_planned_size() -> None:
    records = [
        metrics(1.0, 45, 2),
        metrics(2.6, 46, 2),  # logged just after the kill-all was sent: the old round's
        event(8.0, RESUMED, node="node-5", step=40, source="durable", world_size=2),
        metrics(9.0, 41, 2, node="node-5"),
    ]
    outcome = fault_outcome(records, injection(0, 2.5, "kill-all", 2), float("-inf"), float("inf"))
    assert outcome["recovered_at"] == pytest.approx(START + 9.0)


def test_detect_to_resume_is_the_time_from_the_first_reaction_to_the_round() -> None:
    outcome = fault_outcome(
        _kill_story(), injection(0, 12.5, "kill", 2), float("-inf"), float("inf")
    )
    assert outcome["detect_to_resume_s"] == pytest.approx(18.0 - 12.6)
    row = next(line for line in format_table(_report(_kill_story())).splitlines() if "#0" in line)
    assert " 5.4 " in row


def _report(records: list[dict], end_ts: float | None = None, max_steps: int = 20) -> dict:
    return build_report(
        records,
        [injection(0, 12.5, "kill", 2)],
        start_ts=START,
        global_batch_size=32,
        max_steps=max_steps,
        planned_faults=1,
        end_ts=end_ts,
    )


def test_a_run_that_did_not_finish_is_measured_to_its_end_not_to_the_shutdown() -> None:
    # Settled at t=27; the nodes, stopped after that, still logged a line and a save.
    records = _kill_story() + [
        metrics(28.0, 21, 2, node="node-1"),
        event(30.0, EMERGENCY_SAVE, node="node-1", step=21, reason="sigterm"),
    ]
    run = _report(records, end_ts=START + 27.0, max_steps=100)["run"]
    assert run["finished"] is False
    assert run["wall_s"] == pytest.approx(27.0)
    assert run["final_step"] == 20
    assert run["samples_per_s"] == pytest.approx(20 * 32 / 27.0, abs=0.01)


def _join_story() -> list[dict]:
    """Two nodes train a step every 0.5 s; a third node is added at t=10 and boots for 60 s
    while the two train on; the group re-forms at t=70.2 and trains at 3 from t=72."""
    records = [metrics(1.0 + 0.5 * i, i, 2, loss=2.0 - 0.01 * i) for i in range(1, 139)]
    # Last line at 2 nodes: t=70.0, step 138; the round of three resumes from there.
    records += [
        event(70.2, EMERGENCY_SAVE, step=138, reason="rendezvous"),
        event(71.5, RESUMED, step=138, source="local", world_size=3, lost_steps=0),
    ]
    records += [metrics(72.0 + 0.5 * i, 138 + i, 3, loss=0.6) for i in range(1, 11)]
    return sorted(records, key=lambda r: r["ts"])


def test_a_join_pauses_only_while_the_group_re_forms() -> None:
    records = _join_story()
    report = build_report(
        records,
        [injection(0, 10.0, "join", 3)],
        start_ts=START,
        global_batch_size=32,
        max_steps=148,
        planned_faults=1,
    )
    fault = report["faults"][0]
    assert report["pause_after_s"] == pytest.approx(1.5)  # 3 × the 0.5 s between lines
    assert fault["downtime_s"] == pytest.approx(62.5)  # node added -> training at 3
    # No step ran only from the last line at two (t=70.0) to the first at three (t=72.5).
    assert fault["paused"] == [[START + 70.0, START + 72.5]]
    assert fault["paused_s"] == pytest.approx(2.5)
    assert report["run"]["total_paused_s"] == pytest.approx(2.5)


def test_a_kill_pauses_from_the_injection_not_from_the_last_line() -> None:
    records = _kill_story()
    outcome = fault_outcome(records, injection(0, 12.5, "kill", 2), float("-inf"), float("inf"))
    # Lines every second up to t=13 (step 12); killed at 12.5; the next line is at t=19.5.
    assert outcome["paused"] == [[START + 13.0, START + 19.5]]
    assert pause_after_s(records) == pytest.approx(3.0)


def _marks(fig: Figure, prefix: str) -> dict[str, list[Any]]:
    """x of each vertical line, (x0, x1) of each shaded span, by gid, over every panel."""
    found: dict[str, list[Any]] = {}
    for ax in fig.axes:
        for line in ax.lines:
            if (line.get_gid() or "").startswith(prefix):
                found.setdefault(line.get_gid(), []).append(float(line.get_xdata()[0]))
        for patch in ax.patches:
            if isinstance(patch, Rectangle) and (patch.get_gid() or "").startswith(prefix):
                span = (patch.get_x(), patch.get_x() + patch.get_width())
                found.setdefault(patch.get_gid(), []).append(span)
    return found


@pytest.mark.parametrize("story", ["kill", "join"])
def test_every_mark_on_the_plot_is_a_figure_of_the_report(story: str) -> None:
    if story == "kill":
        records, inj, steps = _kill_story(), injection(0, 12.5, "kill", 2), 20
    else:
        records, inj, steps = _join_story(), injection(0, 10.0, "join", 3), 148
    report = build_report(
        records, [inj], start_ts=START, global_batch_size=32, max_steps=steps, planned_faults=1
    )
    fig = timeline_figure(records, report)
    fault = report["faults"][0]
    for key in ("injected_at", "detected_at", "resumed_at"):
        # One line per panel, at the report's time.
        assert _marks(fig, f"{key}-0")[f"{key}-0"] == [pytest.approx(fault[key] - START)] * 3
    spans = _marks(fig, "paused-0")
    assert sorted(spans) == [f"paused-0-{n}" for n in range(len(fault["paused"]))]
    for n, (begin, end) in enumerate(fault["paused"]):
        assert (
            spans[f"paused-0-{n}"]
            == [(pytest.approx(begin - START), pytest.approx(end - START))] * 3
        )
    run = report["run"]
    title = fig._suptitle.get_text()
    assert f"step {run['final_step']}/{run['max_steps']}" in title
    assert f"{run['total_paused_s']:.1f} s without a step" in title
    assert f"{run['total_downtime_s']:.1f} s to full size" in title
    loss = fig.axes[2].lines[0]
    drawn = [y for y in loss.get_ydata() if y == y]  # NaN: a break where no step ran
    assert drawn == [r["loss"] for r in records if r["kind"] == METRICS]


def _with_rounds(records: list[dict], *spans: tuple[float, float, int]) -> list[dict]:
    """Tag metrics lines in [start, end) with their rendezvous round, as workers log it."""
    for record in records:
        for start, end, rdzv_round in spans:
            if record["kind"] == METRICS and START + start <= record["ts"] < START + end:
                record["rdzv_round"] = rdzv_round
    return records


def test_rounds_one_after_the_other_are_not_two_groups() -> None:
    records = _with_rounds(_kill_story(), (0, 15, 1), (15, 40, 2))
    assert groups_at_once(records) == []
    outcome = fault_outcome(records, injection(0, 12.5, "kill", 2), float("-inf"), float("inf"))
    assert outcome["two_groups"] == [] and outcome["recovered"] is True


def test_two_groups_training_at_once_fail_the_fault() -> None:
    # A second group (round 3) forms beside round 2 and both log steps: split brain.
    records = _with_rounds(_kill_story(), (0, 15, 1), (15, 40, 2))
    records += [{**metrics(20.0 + i, 13 + i, 1, node="node-2"), "rdzv_round": 3} for i in range(3)]
    records.sort(key=lambda r: r["ts"])
    (pair,) = groups_at_once(records)
    assert pair["rounds"] == [2, 3] and pair["from"] == pytest.approx(START + 20.0)
    assert pair["until"] == pytest.approx(START + 22.0)
    outcome = fault_outcome(records, injection(0, 12.5, "kill", 2), float("-inf"), float("inf"))
    assert outcome["recovered"] is False and outcome["two_groups"] == [pair]
    report = build_report(
        records,
        [injection(0, 12.5, "kill", 2)],
        start_ts=START,
        global_batch_size=32,
        max_steps=100,
        planned_faults=1,
    )
    assert report["run"]["two_groups_at_once"] == 1 and not report["run"]["all_recovered"]
    assert format_table(report).splitlines()[2].endswith("SPLIT")


def test_a_line_written_late_counts_at_its_steps_time_not_its_writes() -> None:
    # A node frozen inside its log write (round 1) writes its step's line after the thaw,
    # when round 2 already trains: the step itself passed its permit before the freeze.
    records = _with_rounds(_kill_story(), (0, 15, 1), (15, 40, 2))
    late = {**metrics(20.0, 13, 1, node="node-2"), "rdzv_round": 1, "applied_ts": START + 12.0}
    records = sorted([*records, late], key=lambda r: r["ts"])
    assert groups_at_once(records) == []
    # Let through after round 2 began: a second group, whenever its line was written.
    records.remove(late)
    records = sorted([*records, {**late, "applied_ts": START + 19.9}], key=lambda r: r["ts"])
    (pair,) = groups_at_once(records)
    assert pair["rounds"] == [1, 2]


def test_every_nodes_own_step_log_counts_not_only_rank_0s_metrics() -> None:
    # Round 1's rank 0 stopped at 15 s; its other node, cut off with it, applied a step at
    # 20 s while round 2 trained: only that node's own step_completed line shows it.
    records = _with_rounds(_kill_story(), (0, 15, 1), (15, 40, 2))
    completed = {
        **event(20.5, "step_completed", step=13, world_size=2, node="node-1"),
        "rdzv_round": 1,
        "applied_ts": START + 20.0,
    }
    (pair,) = groups_at_once(sorted([*records, completed], key=lambda r: r["ts"]))
    assert pair["rounds"] == [1, 2]


def test_the_tasks_evaluations_are_the_reports_validation_loss() -> None:
    assert _report(_kill_story())["run"]["validation"] is None  # a task without evaluations
    records = _kill_story() + [
        event(5.0, EVALUATED, step=4, world_size=3, eval_loss=4.25, sample="Frst Ctzn"),
        event(20.5, EVALUATED, node="node-1", step=14, world_size=2, eval_loss=2.5, sample="All:"),
        event(21.0, EVALUATED, step=15, eval_loss=float("nan")),  # diverged: not a number
    ]
    report = _report(sorted(records, key=lambda r: r["ts"]))
    assert report["run"]["validation"] == {
        "evaluations": 2,
        "first_step": 4,
        "first_loss": 4.25,
        "last_step": 14,
        "last_loss": 2.5,
        "last_sample": "All:",
    }
    assert (
        "validation loss 4.2500 at step 4 -> 2.5000 at step 14 (2 evaluations); sampled: 'All:'"
        in format_table(report)
    )


def test_a_run_logged_within_one_clock_tick_has_its_world_sizes_said_without_shares() -> None:
    # Every line of a short run, or of a test's, can carry the same millisecond.
    sizes = {"seconds": {"2": 0.0}, "no_step_s": 0.0, "lost_to_missing_s": 0.0}
    sizes |= {"full_world_size": 2, "lost_share": None, "mean_missing": None}
    line = format_world_sizes({"world_sizes": sizes})
    assert line.startswith("world size: 2 for 0.0 s (-), no step 0.0 s (-);")
