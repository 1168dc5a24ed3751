"""No split brain, ever, even with every core busy while nodes join and leave.

One busy-loop process per core, at normal priority, starves the agents' heartbeats, probes and
watches while the lab kills, evicts, freezes and adds nodes. Every worker logs the rendezvous
round its group formed in; the report's ``two_groups`` finds any two rounds whose groups
trained at the same time. And no live node may be taken for dead: after the first fault, each
fault re-forms the group exactly once, so no round formed that a fault did not call for.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lab.report.node_logs import read_records
from training.records import METRICS, RESUMED

REPO = Path(__file__).resolve().parents[3]

SCENARIO = """
nodes = 3
min_nodes = 1
max_nodes = 3
timeout_s = 540
settle_timeout_s = 180
# The run ends once the last fault settled: under this load each fault takes long to settle,
# and a run to a fixed step count used to finish before its last fault (the join) was due.
stop_when_settled = true

[train]
max_steps = 100000
global_batch_size = 32
micro_batch_size = 16
model_width = 8
model_blocks = 1
log_every = 1
checkpoint_every_steps = 20
min_step_time_s = 0.1
train_records = 1024
test_records = 128

[[faults]]
kind = "kill"
node = 0
at_step = 20

[[faults]]
kind = "join"
at_step = 50

[[faults]]
kind = "evict"
node = 1
at_step = 90

[[faults]]
kind = "freeze"
node = 2
at_step = 130

[[faults]]
kind = "join"
at_step = 170
"""


# heavy: its CPU hogs take both cores, so no other heavy test runs beside it.
@pytest.mark.usefixtures("torchrun", "heavy")
@pytest.mark.timeout(700)
def test_no_two_groups_train_at_once_and_no_live_node_is_taken_for_dead(tmp_path: Path) -> None:
    scenario = tmp_path / "starved.toml"
    scenario.write_text(SCENARIO)
    out = tmp_path / "run"
    hogs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(os.cpu_count() or 1)
    ]
    try:
        result = subprocess.run(
            [sys.executable, "-m", "lab", "run", "--scenario", str(scenario), "--out", str(out)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=660,
        )
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert (out / "report.json").exists(), result.stderr[-4000:]
    report = json.loads((out / "report.json").read_text())
    records = read_records(out / "nodes")
    assert any(r.get("rdzv_round") for r in records if r["kind"] == METRICS)  # it is logged
    assert report["run"]["two_groups_at_once"] == 0, [f["two_groups"] for f in report["faults"]]
    assert report["run"]["all_recovered"], json.dumps(report["faults"], indent=1)[-4000:]
    for fault in report["faults"]:
        if fault["kind"] != "join":
            assert fault["steps_lost"] == 0, fault
    first_fault = report["faults"][0]["injected_at"]
    rounds = {
        r["rdzv_round"]
        for r in records
        if r.get("event") == RESUMED and r["ts"] > first_fault and r.get("rdzv_round")
    }
    assert len(rounds) == len(report["faults"]), sorted(rounds)
