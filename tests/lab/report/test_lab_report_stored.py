"""A run's history in its own storage: every line the workers log, stored through the
``EventLog``'s sink (``training/loop/run_records.py``) and rebuilt by ``lab report`` into the
same report as from the pods' logs. (A real two-node run rebuilt by ``lab report --stack``
after its stdout is gone: tests/training/api/test_user_package_on_the_cluster.py.)"""

from __future__ import annotations

import io
import json
import threading
from pathlib import Path

import pytest

from lab.azure.run_records import fetch_records
from lab.cli import main
from training.checkpoints.deadline import Deadline
from training.checkpoints.storage import FileStore
from training.loop.dist import DistEnv
from training.loop.metrics import EventLog
from training.loop.run_records import StoredRecords, records_uri
from training.records import EMERGENCY_SAVE, EVENT, FINISHED, RECORDS_DROPPED, STARTED


def _log_a_run(log: EventLog, steps: int) -> None:
    log.event(STARTED, world_size=1, max_steps=steps, task="mytask", global_batch_size=8)
    for step in range(1, steps + 1):
        log.metrics(step=step, epoch=0, world_size=1, loss=1.0 / step, samples_per_s=100.0)
    log.event(FINISHED, step=steps, loss=1.0 / steps)


def test_every_line_logged_is_stored_and_comes_back_as_the_nodes_log(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "records")
    stream = io.StringIO()
    log = EventLog(DistEnv(run_id="r1"), stream, sink=StoredRecords(store, "worker-0", 3600))
    _log_a_run(log, 3)
    assert store.list() == []  # nothing per step: once per interval, or at the end
    log.close()
    assert fetch_records(str(tmp_path / "records"), tmp_path / "out", {}) == 1
    assert (tmp_path / "out" / "pods" / "worker-0.log").read_text() == stream.getvalue()


def test_lines_a_failing_store_refused_go_with_the_next_object(tmp_path: Path) -> None:
    class Flaky(FileStore):
        fail = True

        def put(self, name: str, data: bytes | Path) -> int:
            if self.fail:
                self.fail = False
                raise ConnectionError("the blob endpoint did not answer")
            return super().put(name, data)

    store = Flaky(tmp_path / "records")
    records = StoredRecords(store, "worker-1", interval_s=3600, max_bytes=400)
    for index in range(10):
        records.write(json.dumps({"ts": index, "kind": EVENT, "event": "e", "n": index}))
    assert records.flush() is False and store.list() == []
    records.write(json.dumps({"ts": 10, "kind": EVENT, "event": "e", "n": 10}))
    records.close()
    (name,) = store.list()
    lines = [json.loads(line) for line in store.get(name).decode().splitlines()]
    kept = [r["n"] for r in lines if r["event"] == "e"]
    assert lines[0]["event"] == RECORDS_DROPPED and lines[0]["lines"] == 10 - len(kept) + 1
    assert kept == list(range(11 - len(kept), 11))  # the newest, in order, none twice


def test_lab_report_rebuilds_a_run_from_its_stored_records(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = FileStore(tmp_path / "ckpt" / "records")
    for node in ("worker-0", "worker-1"):
        log = EventLog(DistEnv(run_id="r1"), io.StringIO(), sink=StoredRecords(store, node, 3600))
        _log_a_run(log, 4)
        log.close()
    out = tmp_path / "report"
    assert main(["report", "--records-uri", str(tmp_path / "ckpt/records"), "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["source"] == "cluster" and (out / "timeline.png").exists()
    assert sorted(p.name for p in (out / "pods").iterdir()) == ["worker-0.log", "worker-1.log"]
    assert "2 stored record objects" in capsys.readouterr().out


def test_where_the_records_go() -> None:
    blob = "https://labst1.blob.core.windows.net/checkpoints/lab-train"
    assert records_uri("", blob) == f"{blob}/records"
    assert records_uri("", "/runs/a") is None  # a local run keeps its logs
    assert records_uri("/runs/a/records", "/runs/a") == "/runs/a/records"
    assert records_uri("off", blob) is None


def test_a_report_without_logs_nor_records_is_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report"]) == 2
    assert "--logs must be" in capsys.readouterr().err


def test_the_last_upload_at_the_end_does_not_replace_one_still_under_way(tmp_path: Path) -> None:
    """SIGTERM while the sink's thread uploads: the end's own upload is another object, and
    every line is stored once."""
    started, release = threading.Event(), threading.Event()

    class Slow(FileStore):
        def put(self, name: str, data: bytes | Path) -> int:
            if not started.is_set():  # the thread's upload hangs until the end's is done
                started.set()
                assert release.wait(30)
            return super().put(name, data)

    store = Slow(tmp_path / "records")
    records = StoredRecords(store, "worker-0", interval_s=3600, flush_bytes=100)
    records.write(json.dumps({"ts": 0, "kind": EVENT, "event": "e", "n": 0}) + " " * 100)
    assert started.wait(30)  # the thread took the first line and is uploading it
    records.write(json.dumps({"ts": 1, "kind": EVENT, "event": "e", "n": 1}))
    records.close()
    release.set()
    records._thread.join(30)
    stored = [json.loads(line)["n"] for n in store.list() for line in store.get(n).splitlines()]
    assert len(store.list()) == 2 and sorted(stored) == [0, 1]


def test_a_stop_deadline_already_spent_leaves_the_exit_its_margin(tmp_path: Path) -> None:
    """The eviction's save took its whole deadline: the records do not take the seconds after
    it, which the process needs to exit with its code before the kubelet's SIGKILL."""

    class Unreachable(FileStore):
        def put(self, name: str, data: bytes | Path) -> int:
            raise AssertionError("stored after the stop's deadline")

    records = StoredRecords(Unreachable(tmp_path / "records"), "worker-0", interval_s=3600)
    records.write(json.dumps({"ts": 0, "kind": EVENT, "event": EMERGENCY_SAVE}))
    records.close(Deadline.after(0))
    assert len(records._lines) == 1  # kept, not stored: the process ends now
