"""The live view, the status line and the log tail: small pure pieces of the runner."""

from __future__ import annotations

import io
import json
from pathlib import Path

from lab.live.job_view import JobView
from lab.live.status_line import StatusLine, status_text
from lab.report.node_logs import LogTail, read_records
from training.records import DATA_WAITING, EVENT, FINISHED, METRICS, RESUMED, parse


def metrics(ts: float, step: int, world: int) -> dict:
    return {"ts": ts, "kind": METRICS, "step": step, "world_size": world, "loss": 0.5}


def resumed(ts: float, step: int) -> dict:
    return {
        "ts": ts,
        "kind": EVENT,
        "event": RESUMED,
        "step": step,
        "source": "local",
        "world_size": 2,
        "node": "node-1",
    }


def test_settles_after_enough_lines_at_the_planned_size() -> None:
    view = JobView()
    view.reset(10.0)
    view.observe(metrics(11.0, 5, 3))  # still the old world size
    view.observe(resumed(12.0, 5))
    assert view.step == 5 and view.last_event == "resumed step 5 (local), world 2 on node-1"
    view.observe(metrics(13.0, 6, 2))
    assert not view.settled(2, settle_lines=2)
    view.observe(metrics(14.0, 7, 2))
    assert view.settled(2, settle_lines=2)
    assert not view.settled(3, settle_lines=2)


def test_a_late_line_from_an_older_round_does_not_rewind_the_view() -> None:
    view = JobView()
    view.observe(metrics(20.0, 30, 2))
    view.observe(metrics(19.0, 29, 3))
    assert (view.step, view.world_size) == (30, 2)


def test_lines_before_a_reset_do_not_count() -> None:
    view = JobView()
    view.reset(50.0)
    view.observe(metrics(49.0, 1, 2))
    assert view.lines_since_reset == 0


def test_finished() -> None:
    view = JobView()
    view.observe({"ts": 1.0, "kind": EVENT, "event": FINISHED, "step": 9, "node": "node-0"})
    assert view.finished and view.last_event == "finished step 9 on node-0"


def test_status_text() -> None:
    view = JobView(step=120, world_size=3, loss=1.23456, last_event="resumed step 120")
    text = status_text(42.0, view, 300, note="next: kill node-1 @ step 150")
    assert text == (
        "[   42.0s] world 3 | step 120/300 | loss 1.2346 | resumed step 120 | "
        "next: kill node-1 @ step 150"
    )


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_status_line_rewrites_in_place_on_a_tty() -> None:
    stream = _Tty()
    line = StatusLine(stream)
    line.update("long status text")
    line.update("short")
    line.message("fault 0")
    line.close()
    assert stream.getvalue() == (
        "\rlong status text" + "\rshort" + " " * 11 + "\r" + " " * 5 + "\r" + "fault 0\n"
    )


def test_status_line_prints_periodic_plain_lines_otherwise() -> None:
    stream = io.StringIO()
    line = StatusLine(stream, interval_s=5.0)
    for now, text in [(0.0, "a"), (1.0, "b"), (5.5, "c")]:
        line.update(text, now=now)
    assert stream.getvalue() == "a\nc\n"


def test_log_tail_waits_for_whole_lines(tmp_path: Path) -> None:
    path = tmp_path / "node-0.jsonl"
    tail = LogTail(path)
    assert tail.read_lines() == []  # not there yet
    path.write_text('{"a": 1}\n{"b"')
    assert tail.read_lines() == ['{"a": 1}']
    with open(path, "a") as handle:
        handle.write(": 2}\n")
    assert tail.read_lines() == ['{"b": 2}']


def test_only_records_are_parsed(tmp_path: Path) -> None:
    good = {"ts": 2.0, "kind": METRICS, "step": 1}
    assert parse(json.dumps(good), "node-0") == {**good, "node": "node-0"}
    for line in [
        "",
        "W1122 torch warning",
        '{"ts": 1.0}',
        '{"kind": "metrics"}',
        '{"ts": 1, "kind"',
    ]:
        assert parse(line, "node-0") is None
    (tmp_path / "node-1.jsonl").write_text(json.dumps(good) + "\nnoise\n")
    (tmp_path / "node-0.jsonl").write_text(json.dumps({**good, "ts": 1.0}) + "\n")
    assert [(r["node"], r["ts"]) for r in read_records(tmp_path)] == [
        ("node-0", 1.0),
        ("node-1", 2.0),
    ]


def test_a_worker_waiting_for_its_data_shows_why_and_the_command() -> None:
    line = json.dumps(
        {"ts": 5.0, "kind": EVENT, "event": DATA_WAITING, "rank": None, "waited_s": 60,
         "why": "no .staged.json in /mnt/dataset yet", "hint": "upload it with `lab data upload`"}
    )  # fmt: skip
    view = JobView()
    record = parse(line, "mytask-train-worker-0")
    assert record is not None
    view.observe(record)
    assert view.last_event.startswith("data_waiting 60 s: no .staged.json in /mnt/dataset yet")
    assert "lab data upload" in view.last_event and view.last_event.endswith("worker-0")
