"""Saved cluster logs into the report: pod logs as `kubectl logs --timestamps` prints them,
the cluster's events, faults inferred, a replacement's arrival and the run's cost."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest

from lab.cli import main
from lab.report.gpu_cost import cost_of_run
from lab.report.run_logs import (
    RunLogsError,
    cluster_event,
    load_cluster_run,
    load_run,
    parse_pod_log,
    parse_time,
)
from lab.report.run_report import report_from_run
from lab.report.text import format_report
from lab.report.world_sizes import world_size_time
from tests.support.pod_logs import (
    NEW_NODE,
    NS,
    T0,
    W0,
    W2,
    eviction_logs,
    eviction_story,
    metrics,
    stamp,
)
from training.records import EVENT, METRICS, RESUMED, STARTED


def test_times_as_kubernetes_writes_them() -> None:
    utc = datetime.fromtimestamp(T0, UTC)
    assert parse_time(utc.strftime("%Y-%m-%dT%H:%M:%S.123456789Z")) == pytest.approx(
        T0 + 0.123456789
    )
    plus_two = datetime.fromtimestamp(T0 + 7200, UTC).strftime("%Y-%m-%dT%H:%M:%S+02:00")
    assert parse_time(plus_two) == T0
    with pytest.raises(ValueError, match="not an RFC 3339 time"):
        parse_time("yesterday")


def test_a_pod_log_keeps_the_training_records_and_skips_the_rest() -> None:
    text = "\n".join(
        [metrics(1.0, 1, 3), f"{stamp(T0 + 2)} Traceback (most recent call last):", "{torn"]
    )
    records = parse_pod_log(text, W0)
    assert [(r["step"], r["node"]) for r in records] == [(1, W0)]


def test_an_events_k8s_io_event_reads_the_same() -> None:
    new_api = {
        "reason": "Scheduled",
        "regarding": {"kind": "Pod", "name": W0},
        "note": f"Successfully assigned {NS}/{W0} to node-a",
        "eventTime": stamp(T0 + 0.5),
    }
    found = cluster_event(new_api)
    assert found is not None
    assert (found.ts, found.kind, found.name) == (T0 + 0.5, "Pod", W0)
    assert cluster_event({"reason": "x"}) is None  # no time: nothing to place it at


def test_an_eviction_is_inferred_from_the_logs_and_dated_by_its_first_sign(
    tmp_path: Path,
) -> None:
    run = load_run(eviction_story(tmp_path))
    assert (run.source, run.max_steps, run.global_batch_size) == ("cluster", 400, 256)
    leave, join = run.injections
    # The pod's Killing event (t=100) comes before the worker's own emergency save.
    assert (leave["kind"], leave["injected_at"], leave["planned_world_size"]) == (
        "leave",
        T0 + 100.0,
        2,
    )
    # The join began when the new node was asked for, while two workers trained on.
    assert (join["kind"], join["injected_at"], join["planned_world_size"]) == (
        "join",
        T0 + 110.0,
        3,
    )


def test_the_report_of_a_cluster_run_with_the_replacements_arrival(tmp_path: Path) -> None:
    report = report_from_run(load_run(eviction_story(tmp_path)))
    leave, join = report["faults"]
    assert (leave["world_size_before"], leave["world_size_after"]) == (3, 2)
    assert leave["steps_lost"] == 0 and leave["resume_source"] == "local"
    assert leave["paused"] == [[T0 + 100.0, T0 + 105.0]]  # killed at 100, stepping at 105
    assert join["paused"] == [[T0 + 403.0, T0 + 409.0]]  # not the 290 s the node booted
    arrival = leave["arrival"]
    assert arrival == {
        "pod": W2 + "x",
        "node": NEW_NODE,
        "scale_up_at": T0 + 110.0,
        "node_registered_at": T0 + 290.0,
        "scheduled_at": T0 + 300.0,
        "image_pulled_at": T0 + 390.0,
        "started_at": T0 + 400.0,
        "joined_at": T0 + 409.0,
        "arrival_s": 309.0,
    }


def test_the_cost_of_a_run_is_its_pods_hours_at_each_price(tmp_path: Path) -> None:
    run = load_run(eviction_story(tmp_path))
    cost = cost_of_run(run, 0.0915, 0.526, "test prices")
    # worker-0 1..413 s, worker-1 1..1 s, worker-2 1..100.2 s, the new pod 400..400 s.
    hours = (412.0 + 0.0 + 99.2 + 0.0) / 3600
    assert cost["gpu_node_hours"] == pytest.approx(hours, abs=1e-4)
    assert cost["spot_usd"] == pytest.approx(hours * 0.0915, abs=1e-4)
    # No on-demand node in the story: all of it ran at Spot; all on demand it would cost:
    assert (cost["spot_node_hours"], cost["on_demand_node_hours"]) == (cost["gpu_node_hours"], 0)
    assert cost["on_demand_usd"] == 0 and cost["total_usd"] == cost["spot_usd"]
    assert cost["all_on_demand_usd"] == pytest.approx(hours * 0.526, abs=1e-4)


def test_report_command_writes_the_three_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    logs = eviction_story(tmp_path / "logs")
    out = tmp_path / "out"
    argv = ["report", "--logs", str(logs), "--out", str(out), "--spot-price", "0.1"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "fault 0: replacement" in text and "in 309 s" in text
    assert "at Spot" in text and "prices given on the command line" in text
    report = json.loads((out / "report.json").read_text())
    assert report["cost"]["spot_usd_per_h"] == 0.1
    assert (out / "report.txt").read_text().startswith(" #  fault")
    assert (out / "timeline.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    ("setup", "argv", "message"),
    [
        ("none", [], "is not a directory"),
        ("empty", [], "holds no training records"),
        ("old", [], "pass --max-steps and --global-batch-size"),
        ("story", ["--spot-price", "-1"], "--spot-price must be > 0"),
        ("story", ["--spot-price", "nan"], "--spot-price must be > 0"),
        ("garbage", [], "holds no training records"),
        ("events.jsonl", [], "events.jsonl line 1 is not a JSON object"),
        ("events.json", [], "events.json is not an event list"),
        ("event time", [], "holds an event the report cannot read: not an RFC 3339 time"),
        ("drill-events.jsonl", [], "drill-events.jsonl: record 1 has no valid 'event'"),
        ("drill fault", [], "drill-events.jsonl: record 1 has no valid 'kind'"),
        ("binary", [], "events.jsonl: cannot read it"),
        ("lab-events.jsonl", [], "lab-events.jsonl line 1 is not a JSON object"),
    ],
)
def test_report_command_bad_input(
    setup: str, argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    logs = tmp_path / "logs"
    if setup == "none":
        pass
    elif setup == "empty":
        logs.mkdir()
    elif setup == "old":
        (logs / "pods").mkdir(parents=True)
        (logs / "pods" / f"{W0}.log").write_text(metrics(1.0, 1, 3) + "\n")
    elif setup == "garbage":
        logs.mkdir()
        (logs / "notes.txt").write_text("not a log\n")
        (logs / "w.log").write_bytes(bytes(range(256)) * 4)
    elif setup == "lab-events.jsonl":
        (logs / "nodes").mkdir(parents=True)
        (logs / "lab-events.jsonl").write_text("garbage\n")
    else:
        eviction_story(logs)
        side = {
            "events.jsonl": "{garbage\n",
            "events.json": json.dumps({"items": [1, "x"]}),
            "event time": json.dumps({"items": [{"lastTimestamp": "yesterday"}]}),
            "drill-events.jsonl": json.dumps({"ts": T0}) + "\n",
            "drill fault": json.dumps({"ts": T0, "event": "fault_injected", "index": 0}) + "\n",
        }
        if setup in side:
            name = "drill-events.jsonl" if setup.startswith("drill") else setup
            name = "events.json" if setup == "event time" else name
            (logs / name).write_text(side[setup])
        if setup == "binary":
            (logs / "events.jsonl").write_bytes(b"\xff\xfe\x00\x01")
    assert main(["report", "--logs", str(logs), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert len(err.strip().splitlines()) == 1


def test_lines_that_only_look_like_records_are_skipped(tmp_path: Path) -> None:
    logs = eviction_story(tmp_path / "logs")
    good = load_run(logs)
    stray = [
        {"ts": T0 + 50.5, "kind": METRICS},  # no step, world size or loss
        {"ts": T0 + 50.6, "kind": METRICS, "step": "a", "world_size": 3, "loss": 1.0},
        {"ts": float("nan"), "kind": METRICS, "step": 3, "world_size": 3, "loss": 1.0},
        {"ts": True, "kind": METRICS, "step": 3, "world_size": 3, "loss": 1.0},
        {"ts": T0 + 50.7, "kind": EVENT},  # no event name
        {"ts": T0 + 50.8, "kind": EVENT, "event": RESUMED},  # a round without its step
        {"ts": T0 + 50.9, "kind": EVENT, "event": STARTED, "max_steps": "x"},
    ]
    (logs / "pods" / "stray.log").write_text("\n".join(json.dumps(r) for r in stray) + "\n")
    run = load_run(logs)
    assert [r for r in run.records if r["node"] == "stray"] == []
    assert report_from_run(run)["faults"] == report_from_run(good)["faults"]


def test_a_side_file_cut_off_mid_write_loses_only_its_last_line(tmp_path: Path) -> None:
    logs = eviction_story(tmp_path / "logs")
    events = json.loads((logs / "events.json").read_text())["items"]
    (logs / "events.json").unlink()
    text = "\n".join(json.dumps(e) for e in events)
    (logs / "events.jsonl").write_text(text + "\n" + json.dumps(events[0])[:40])
    assert len(load_run(logs).cluster_events) == len(events)


def test_old_logs_take_the_target_from_flags(tmp_path: Path) -> None:
    (tmp_path / f"{W0}.log").write_text(metrics(1.0, 1, 3) + "\n" + metrics(2.0, 2, 3) + "\n")
    with pytest.raises(RunLogsError):
        load_cluster_run(tmp_path)
    run = load_cluster_run(tmp_path, max_steps=10, global_batch_size=64)
    assert (run.max_steps, run.injections) == (10, [])


def test_the_time_at_each_world_size_and_what_the_missing_worker_cost(tmp_path: Path) -> None:
    texts, events = eviction_logs()
    # At two workers the logs say 340 samples/s, at three 500: a second at two trains 68 %.
    texts[W0] = "\n".join(
        line.replace('"samples_per_s": 500.0', '"samples_per_s": 340.0')
        if '"world_size": 2' in line
        else line
        for line in texts[W0].splitlines()
    )
    (tmp_path / "pods").mkdir()
    for pod, text in texts.items():
        (tmp_path / "pods" / f"{pod}.log").write_text(text)
    (tmp_path / "events.json").write_text(json.dumps({"kind": "List", "items": events}))
    report = report_from_run(load_run(tmp_path))
    sizes = report["world_sizes"]
    # Three from t=3 to 99 and 409 to 412; two from 105 to 403; the two re-forms 6 s each.
    assert sizes["seconds"] == {"2": 298.0, "3": 99.0}
    assert sizes["no_step_s"] == 12.0
    assert sizes["lost_to_missing_s"] == pytest.approx(298 * (1 - 340 / 500))
    assert sizes["lost_share"] == pytest.approx(298 * 0.32 / 397, abs=1e-4)
    assert sizes["mean_missing"] == pytest.approx(298 / 397, abs=1e-4)
    text = format_report(report)
    assert (
        "world size: 3 for 99.0 s (24%), 2 for 298.0 s (73%), no step 12.0 s (3%); missing "
        "workers cost 95.4 s of training at full size 3 (24% of the time with a step), 0.75 "
        "ranks missing on average"
    ) in text


def test_a_size_that_logged_no_rate_counts_by_its_share_of_the_workers() -> None:
    records = [
        {"kind": METRICS, "ts": float(t), "world_size": 4 if t < 10 else 3, "step": t}
        for t in range(20)
    ]
    sizes = world_size_time(records, 0.0, 19.0, pause_after=3.0)
    assert sizes is not None and sizes["seconds"] == {"3": 10.0, "4": 9.0}
    assert sizes["lost_to_missing_s"] == pytest.approx(10 * (1 - 3 / 4))
    assert world_size_time(records[:1], 0.0, 19.0, pause_after=3.0) is None
