"""One lab session: etcd, dataset, nodes, the scenario, then the report; always cleaned up.

Run outputs (node logs, the lab's event log, ``report.json``, ``timeline.png``) go to the
output dir. Everything else (etcd's data, checkpoints, node-local dirs, a generated
dataset) lives in a temp dir that is removed when the session ends, however it ends.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import training
from lab.etcd_server import EmbeddedEtcd, find_etcd_binary
from lab.node import NodeLaunch, TorchrunNode, node_env
from lab.node_logs import read_jsonl, read_records
from lab.report import build_report, format_table
from lab.runner import FaultRunner, LabEventLog, RunOutcome
from lab.scenario import Scenario, validate_scenario
from lab.status_line import StatusLine
from lab.timeline_plot import plot_timeline
from training.launch import ElasticPolicy, train_command

REPO_ROOT = Path(training.__file__).resolve().parent.parent
# Agents that did not exit on their own after training finished get this long on SIGTERM.
STOP_GRACE_S = 10.0


class LabError(RuntimeError):
    """The lab cannot start: a missing dataset, a dataset that could not be written."""


@dataclass(frozen=True)
class SessionOptions:
    """What the command line decides besides the scenario."""

    out_dir: Path
    data_dir: Path | None = None
    """An existing CIFAR-10 binary dir; None writes a synthetic one."""
    etcd_binary: str | None = None
    python: str = sys.executable


def write_dataset(out: Path, scenario: Scenario, python: str) -> Path:
    """A synthetic dataset from ``python -m training.data``; raise LabError if it fails."""
    train = scenario.train
    command = [
        python,
        "-m",
        "training.data",
        f"--out={out}",
        f"--train-records={train.train_records}",
        f"--test-records={train.test_records}",
        f"--seed={train.seed}",
    ]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        raise LabError(f"writing the synthetic dataset failed:\n{result.stderr[-2000:]}")
    return out


def check_data_dir(data_dir: Path) -> Path:
    """``data_dir`` if it is a directory with files; LabError naming --data-dir otherwise."""
    if not data_dir.is_dir():
        raise LabError(f"--data-dir: {data_dir} does not exist or is not a directory")
    if not any(data_dir.iterdir()):
        raise LabError(f"--data-dir: {data_dir} is empty; expected CIFAR-10 binary batches")
    return data_dir.resolve()


class NodeSet:
    """Makes the scenario's nodes and stops every one of them on exit."""

    def __init__(
        self,
        scenario: Scenario,
        policy: ElasticPolicy,
        work: Path,
        log_dir: Path,
        data_dir: Path,
        python: str,
    ) -> None:
        self.scenario, self.policy, self.work = scenario, policy, work
        self.log_dir, self.data_dir, self.python = log_dir, data_dir, python
        self.nodes: list[TorchrunNode] = []

    def make(self, number: int) -> TorchrunNode:
        """Node ``number``: a fresh node-local dir, the shared durable checkpoint dir."""
        local_dir = self.work / "local" / f"node-{number}"
        env = node_env(
            self.policy,
            checkpoint_uri=str(self.work / "checkpoints"),
            local_dir=local_dir,
            collective_timeout_s=self.scenario.train.collective_timeout_s,
        )
        command = train_command(self.scenario.train.args(str(self.data_dir)), self.python)
        launch = NodeLaunch(f"node-{number}", command, env, REPO_ROOT, self.log_dir, local_dir)
        node = TorchrunNode(launch)
        self.nodes.append(node)
        return node

    def stop_all(self) -> None:
        """SIGTERM every node's agent, SIGKILL its tree after a grace period. Idempotent."""
        for node in self.nodes:
            node.terminate(STOP_GRACE_S)

    def __enter__(self) -> NodeSet:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop_all()


def _policy(scenario: Scenario, port: int) -> ElasticPolicy:
    policy = ElasticPolicy(
        rdzv_host="127.0.0.1",
        rdzv_port=port,
        rdzv_id=f"lab-{uuid.uuid4().hex[:12]}",  # a closed rendezvous stays closed for its id
        min_nodes=scenario.min_nodes,
        max_nodes=scenario.max_nodes,
        max_restarts=scenario.max_restarts,
        rendezvous=scenario.rendezvous,
    )
    policy.validate()
    return policy


def check_out_dir(out: Path) -> Path:
    """``out`` if it is new or empty: appending to another run's logs would mix two runs."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise LabError(f"--out: {out} already exists and is not empty; choose a new directory")
    return out


def run_session(
    scenario: Scenario, options: SessionOptions, status: StatusLine | None
) -> dict[str, Any]:
    """Run ``scenario`` end to end; the report (also written to ``options.out_dir``)."""
    plan = validate_scenario(scenario)
    binary = find_etcd_binary(options.etcd_binary)
    data_dir = check_data_dir(options.data_dir) if options.data_dir else None
    out = check_out_dir(options.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "scenario.json").write_text(json.dumps(dataclasses.asdict(scenario), indent=2))
    with tempfile.TemporaryDirectory(prefix="spot-lab-") as work_dir:
        work = Path(work_dir)
        data_dir = data_dir or write_dataset(work / "data", scenario, options.python)
        etcd = EmbeddedEtcd(binary, work / "etcd-data", out / "etcd.log")
        with etcd:
            policy = _policy(scenario, etcd.client_port)
            lab_log = LabEventLog(out / "lab-events.jsonl")
            lab_log.write(
                "session_started",
                workspace=str(work),
                etcd=etcd.client_url,
                rdzv_id=policy.rdzv_id,
                data_dir=str(data_dir),
            )
            with NodeSet(scenario, policy, work, out / "nodes", data_dir, options.python) as nodes:
                runner = FaultRunner(scenario, plan, nodes.make, etcd, lab_log, status)
                outcome = runner.run()
                if status is not None:
                    status.close()
    return write_report(scenario, outcome, out)


def write_report(scenario: Scenario, outcome: RunOutcome, out: Path) -> dict[str, Any]:
    """Build the report from the logs in ``out``; write report.json and timeline.png."""
    records = read_records(out / "nodes")
    lab_events = read_jsonl(out / "lab-events.jsonl")
    injections = [r for r in lab_events if r["event"] == "fault_injected"]
    report = build_report(
        records,
        injections,
        start_ts=outcome.start_ts,
        global_batch_size=scenario.train.global_batch_size,
        max_steps=scenario.train.max_steps,
        planned_faults=len(scenario.faults),
    )
    # Agents still in their exit barrier after training finished: a pod that never completes.
    report["run"]["lingering_nodes"] = [
        r["node"] for r in lab_events if r["event"] == "node_lingered"
    ]
    report["scenario"] = scenario.name
    report["outcome"] = {"status": outcome.status, "message": outcome.message}
    (out / "report.json").write_text(json.dumps(report, indent=2))
    (out / "report.txt").write_text(format_table(report) + "\n")
    plot_timeline(records, report, out / "timeline.png")
    return report
