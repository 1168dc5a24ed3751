"""The faulty store the chaos bench puts in front of the workers' durable store."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from training.checkpoints.deadline import Deadline, DeadlineExceeded
from training.checkpoints.faulty_store import (
    FAULTY_STORE_ENV,
    FAULTY_STORE_LOG_ENV,
    FaultyStore,
    Windows,
)
from training.checkpoints.storage import FileStore
from training.checkpoints.stores import open_store


def _window(control: Path, **fields: object) -> None:
    now = time.time()
    line = {"from": now - 1, "until": now + 60, **fields}
    with open(control, "a") as f:
        f.write(json.dumps(line) + "\n")


@pytest.fixture
def control(tmp_path: Path) -> Path:
    path = tmp_path / "control.jsonl"
    path.touch()
    return path


def test_without_a_window_every_call_goes_through(tmp_path: Path, control: Path) -> None:
    store = FaultyStore(FileStore(tmp_path / "s"), Windows(control))
    assert store.put("a", b"xy") == 2 and store.get("a") == b"xy" and store.list() == ["a"]


def test_a_failing_window_fails_the_calls_it_names_only(tmp_path: Path, control: Path) -> None:
    store = FaultyStore(FileStore(tmp_path / "s"), Windows(control))
    store.put("a", b"x")
    _window(control, fail=True, ops=["put"])
    with pytest.raises(OSError, match="injected store failure"):
        store.put("b", b"y")
    assert store.get("a") == b"x"  # reads are not in the window


def test_a_window_that_ended_changes_nothing(tmp_path: Path, control: Path) -> None:
    store = FaultyStore(FileStore(tmp_path / "s"), Windows(control))
    now = time.time()
    control.write_text(json.dumps({"from": now - 10, "until": now - 5, "fail": True}) + "\n")
    store.put("a", b"x")


def test_a_delay_past_a_bounded_views_deadline_times_out_as_a_real_store_would(
    tmp_path: Path, control: Path
) -> None:
    store = FaultyStore(FileStore(tmp_path / "s"), Windows(control))
    _window(control, delay_s=30.0)
    bounded = store.bounded(Deadline.after(0.05))
    with pytest.raises(DeadlineExceeded):
        bounded.put("a", b"x")
    assert FileStore(tmp_path / "s").list() == []


def test_uploads_and_every_call_are_logged_with_duration_and_outcome(
    tmp_path: Path, control: Path
) -> None:
    log = tmp_path / "store.jsonl"
    store = FaultyStore(FileStore(tmp_path / "s"), Windows(control), log)
    store.put("ckpt-1-a.pt", b"x")
    store.put("ckpt-2-b.0-0.distcp", b"x")  # a rank's file of a sharded checkpoint
    store.put("ckpt-2-b.json", b"{}")  # not an upload: a commit's small object
    with pytest.raises(FileNotFoundError):
        store.get("missing")
    _window(control, fail=True, ops=["get"])
    with pytest.raises(OSError):
        store.get("ckpt-1-a.pt")
    _window(control, delay_s=0.2, ops=["list"])
    assert store.list() == ["ckpt-1-a.pt", "ckpt-2-b.0-0.distcp", "ckpt-2-b.json"]
    bounded = store.bounded(Deadline.after(0.05))
    with pytest.raises(DeadlineExceeded):
        bounded.list()
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(e["op"], e["what"], e.get("outcome")) for e in lines] == [
        ("put", "upload", None),
        ("put", "call", "ok"),
        ("put", "upload", None),
        ("put", "call", "ok"),
        ("put", "call", "ok"),
        ("get", "call", "FileNotFoundError"),
        ("get", "call", "failed"),
        ("list", "call", "ok"),
        ("list", "call", "timed out"),
    ]
    calls = [e for e in lines if e["what"] == "call"]
    assert calls[0]["name"] == "ckpt-1-a.pt" and calls[0]["delay_s"] == 0.0
    assert calls[4]["fail"] is True
    delayed, cut = calls[5], calls[6]
    assert delayed["delay_s"] == 0.2 and delayed["duration_s"] >= 0.2
    assert cut["duration_s"] < 0.2  # the deadline cut the injected delay short
    assert all(e["ts"] <= f["ts"] for e, f in zip(calls, calls[1:], strict=False))


def test_a_window_appended_while_the_store_runs_is_read(tmp_path: Path, control: Path) -> None:
    store = FaultyStore(FileStore(tmp_path / "s"), Windows(control))
    store.put("a", b"x")
    with open(control, "a") as f:
        f.write('{"from": 0, "until": 1e12, "fail": tru')  # half written: not read yet
    store.put("b", b"x")
    with open(control, "a") as f:
        f.write("e}\n")
    with pytest.raises(OSError):
        store.put("c", b"x")


def test_open_store_wraps_only_when_the_bench_asks(
    tmp_path: Path, control: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert isinstance(open_store(str(tmp_path / "plain")), FileStore)
    monkeypatch.setenv(FAULTY_STORE_ENV, str(control))
    monkeypatch.setenv(FAULTY_STORE_LOG_ENV, str(tmp_path / "log.jsonl"))
    store = open_store(str(tmp_path / "wrapped"))
    assert isinstance(store, FaultyStore) and store.log == tmp_path / "log.jsonl"


def test_a_slow_window_holds_each_call(tmp_path: Path, control: Path) -> None:
    store = FaultyStore(FileStore(tmp_path / "s"), Windows(control))
    _window(control, delay_s=0.2, ops=["put"])
    started = time.monotonic()
    store.put("a", b"x")
    assert time.monotonic() - started >= 0.2  # a sleep lasts at least its time
    store.get("a")
