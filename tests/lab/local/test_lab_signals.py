"""``python -m lab run`` stopped by a signal while real agents train: it exits with 128 + the
signal, leaves no process of the run and no workspace behind, and still writes its report.
A second Ctrl-C during the cleanup does not cut the cleanup short."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.lab_runs import _processes_of_the_run
from tests.support.waiting import wait_until

REPO_ROOT = Path(__file__).resolve().parents[3]
# Writing the dataset, etcd, three agents, import torch and the first round, on 2 busy cores.
TRAINING_STARTS_WITHIN_S = 180.0


def _start_lab(out: Path) -> subprocess.Popen[bytes]:
    with open(out.parent / "lab.log", "wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "lab", "run", "--ci", "--out", str(out)],
            cwd=REPO_ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # our signals go to the lab alone, not to pytest
        )


def _wait_until_training(out: Path, lab: subprocess.Popen[bytes]) -> dict[str, Any]:
    """The session_started event, once a node logged its first step."""

    def trained() -> bool:
        assert lab.poll() is None, (out.parent / "lab.log").read_text()[-3000:]
        return any(
            '"kind": "metrics"' in line
            for path in (out / "nodes").glob("*.jsonl")
            for line in path.read_text(errors="replace").splitlines()
        )

    wait_until(trained, TRAINING_STARTS_WITHIN_S, "a node's first step")
    events = [json.loads(x) for x in (out / "lab-events.jsonl").read_text().splitlines()]
    return next(e for e in events if e["event"] == "session_started")


def _stop_and_check(
    tmp_path: Path, signals: list[signal.Signals], expected_code: int
) -> dict[str, Any]:
    out = tmp_path / "run"
    lab = _start_lab(out)
    try:
        session = _wait_until_training(out, lab)
        for sig in signals:
            os.kill(lab.pid, sig)
            time.sleep(0.3)  # the second one lands while the nodes are being stopped
        code = lab.wait(timeout=90)
    finally:
        if lab.poll() is None:
            lab.kill()
            lab.wait()
    log = (out.parent / "lab.log").read_text()
    assert code == expected_code, log[-3000:]
    assert _processes_of_the_run(session["rdzv_id"], session["workspace"]) == []
    assert not Path(session["workspace"]).exists()
    report = json.loads((out / "report.json").read_text())
    assert report["outcome"]["status"] == "interrupted"
    return report


@pytest.mark.usefixtures("torchrun")
@pytest.mark.timeout(300)
def test_sigterm_stops_everything_and_exits_143(tmp_path: Path) -> None:
    _stop_and_check(tmp_path, [signal.SIGTERM], 143)


@pytest.mark.usefixtures("torchrun")
@pytest.mark.timeout(300)
def test_a_second_ctrl_c_does_not_cut_the_cleanup_short(tmp_path: Path) -> None:
    _stop_and_check(tmp_path, [signal.SIGINT, signal.SIGINT], 130)
