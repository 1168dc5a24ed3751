"""The faulty store the chaos bench puts in front of the workers' durable store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.chaos.faulty_store import FaultyStore, Windows, faulty_env, from_env
from training.checkpoints.deadline import Deadline, DeadlineExceeded
from training.checkpoints.storage import FileStore
from training.checkpoints.stores import STORE_WRAP_ENV, open_store, wrap_from_env

REPO = Path(__file__).resolve().parents[3]


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


def test_open_store_wraps_a_store_only_when_asked(tmp_path: Path, control: Path) -> None:
    assert isinstance(open_store(str(tmp_path / "plain")), FileStore)
    wrapped = open_store(
        str(tmp_path / "w"), wrap=lambda inner: FaultyStore(inner, Windows(control))
    )
    assert isinstance(wrapped, FaultyStore) and isinstance(wrapped.inner, FileStore)
    _window(control, fail=True)
    with pytest.raises(OSError, match="injected store failure"):
        wrapped.put("a", b"x")


@pytest.mark.usefixtures("processes")
def test_a_worker_started_with_the_faulty_env_opens_faulty_stores(
    tmp_path: Path, control: Path
) -> None:
    """What a node the campaign starts inherits: its own ``open_store`` calls, in a process of
    its own, wrap every store, and log the calls."""
    env = faulty_env(control, tmp_path / "log.jsonl")
    assert wrap_from_env({}) is None
    assert wrap_from_env(env) is from_env
    script = (
        "from training.checkpoints.stores import STORE_WRAP_ENV, open_store, wrap_from_env\n"
        f"store = open_store({str(tmp_path / 's')!r})\n"
        "store.put('a', b'x')\n"
        "print(type(store).__name__)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, **env},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,  # a hang guard
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "FaultyStore"
    (call,) = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert (call["op"], call["name"], call["outcome"]) == ("put", "a", "ok")


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("bench.chaos.faulty_store", "must be module:callable"),
        ("bench.chaos.nowhere:from_env", "No module named"),
        ("bench.chaos.faulty_store:nothing", "has no attribute"),
        ("bench.chaos.faulty_store:FAULTY_STORE_ENV", "is not callable"),
    ],
)
def test_a_wrap_named_wrong_is_refused_with_the_setting(spec: str, says: str) -> None:
    with pytest.raises(ValueError, match=f"TRAIN_STORE_WRAP.*{says}"):
        wrap_from_env({STORE_WRAP_ENV: spec})


def test_a_slow_window_holds_each_call(tmp_path: Path, control: Path) -> None:
    store = FaultyStore(FileStore(tmp_path / "s"), Windows(control))
    _window(control, delay_s=0.2, ops=["put"])
    started = time.monotonic()
    store.put("a", b"x")
    assert time.monotonic() - started >= 0.2  # a sleep lasts at least its time
    store.get("a")
