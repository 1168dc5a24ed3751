"""One lab session: etcd, dataset, nodes, the scenario, then the report; always cleaned up.

Run outputs (node logs, the lab's event log, ``report.json``, ``timeline.png``) go to the
output dir. Everything else (etcd's data, checkpoints, node-local dirs, every node's TMPDIR,
a generated dataset) lives in a temp dir that is removed when the session ends, however it
ends: after every node and etcd stopped and every process that still mentions the temp dir
was killed.

Every input is checked before anything is created. A setup step that fails (writing the
dataset, starting etcd) removes the output dir again, so a rerun with the same ``--out``
works.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import training
from lab.live.event_log import LabEventLog
from lab.live.status_line import StatusLine
from lab.local import process_tree
from lab.local.etcd_server import EmbeddedEtcd, find_etcd_binary
from lab.local.interrupts import InterruptGuard, interrupt_guard
from lab.local.netns import Network
from lab.local.node import NodeLaunch, TorchrunNode, node_env, stop_nodes
from lab.local.run_extension import write_max_steps
from lab.local.runner import FaultRunner, RunOutcome
from lab.local.scenario import (
    SYNTHETIC_TRAIN_FILES,
    MembershipChange,
    Scenario,
    TrainSettings,
    validate_scenario,
)
from lab.report.run_logs import load_lab_run
from lab.report.run_report import report_from_run, write_outputs
from training.elastic.launch import ElasticPolicy, train_command

REPO_ROOT = Path(training.__file__).resolve().parent.parent
CORPUS_SAMPLE = REPO_ROOT / "training" / "data" / "samples" / "tinyshakespeare" / "input.txt"
"""The character LM's data in the lab: an excerpt of Tiny Shakespeare shipped in the repo."""
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
    """The task's dataset for the run: a synthetic CIFAR-10 from ``python -m
    training.data.cifar10``, or the corpus excerpt shipped in the repo; LabError if it fails."""
    train = scenario.train
    if train.task != "cifar":
        out.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(CORPUS_SAMPLE, out / CORPUS_SAMPLE.name)
        return out
    command = [
        python,
        "-m",
        "training.data.cifar10",
        f"--out={out}",
        f"--train-records={train.train_records}",
        f"--test-records={train.test_records}",
        f"--train-files={SYNTHETIC_TRAIN_FILES}",
        f"--seed={train.seed}",
    ]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        raise LabError(f"writing the synthetic dataset failed:\n{result.stderr[-2000:]}")
    return out


def check_data_dir(data_dir: Path, train: TrainSettings) -> Path:
    """``data_dir`` resolved, once the task's own loader read its training samples; LabError
    naming --data-dir otherwise: every worker would fail on it at start."""
    if not data_dir.is_dir():
        raise LabError(f"--data-dir: {data_dir} does not exist or is not a directory")
    # Imported here: the loaders import torch, which the lab needs for this check only.
    from training.data.cifar10 import DatasetError
    from training.loop.config import parse_config
    from training.loop.inputs import load_data

    cfg = parse_config([*train.args(str(data_dir)), "--checkpoint-uri=<checkpoints>"], env={})
    try:
        records = len(load_data(cfg).train)
    except DatasetError as err:  # the task's loader names --data-dir, CIFAR-10's the file
        message = str(err)
        named = message if message.startswith("--data-dir") else f"--data-dir: {message}"
        raise LabError(named) from None
    if records < train.global_batch_size:
        raise LabError(
            f"--data-dir: {data_dir} holds {records} training samples; allowed: >= "
            f"train.global_batch_size ({train.global_batch_size})"
        )
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
        network: Network | None = None,
    ) -> None:
        self.scenario, self.policy, self.work = scenario, policy, work
        self.log_dir, self.data_dir, self.python = log_dir, data_dir, python
        # Each node in a network namespace of its own on ``network`` (None: the host's); the
        # policy's rdzv_host is then the network's host address, where etcd listens.
        self.network = network
        self.nodes: list[TorchrunNode] = []
        self.max_steps_file = work / "max-steps"

    def make(self, number: int) -> TorchrunNode:
        """Node ``number``: fresh node-local and temp dirs, the shared durable checkpoint dir."""
        name = f"node-{number}"
        local_dir, tmp_dir = self.work / "local" / name, self.work / "tmp" / name
        env = node_env(
            self.policy,
            checkpoint_uri=str(self.work / "checkpoints"),
            local_dir=local_dir,
            collective_timeout_s=self.scenario.train.collective_timeout_s,
            tmp_dir=tmp_dir,
            launcher=self.scenario.launcher,
        )
        args = self.scenario.train.args(str(self.data_dir))
        if self.scenario.faults:  # where the lab moves the end when faults fall behind
            args.append(f"--max-steps-file={self.max_steps_file}")
        command = train_command(args, self.python)
        if self.network is not None:
            # ``ip netns exec`` execs the agent: same pid, so signals reach the same tree.
            self.network.add(name)
            env |= self.network.env(name)
            command = self.network.command(name, command)
        launch = NodeLaunch(name, command, env, REPO_ROOT, self.log_dir, local_dir, tmp_dir)
        node = TorchrunNode(launch)
        self.nodes.append(node)
        return node

    def stop_all(self) -> None:
        """Stop every node at once: SIGTERM, one shared grace period, SIGKILL. Idempotent."""
        stop_nodes(self.nodes, STOP_GRACE_S)

    def __enter__(self) -> NodeSet:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop_all()


def _policy(scenario: Scenario, port: int, rdzv_id: str) -> ElasticPolicy:
    policy = ElasticPolicy(
        rdzv_host="127.0.0.1",
        rdzv_port=port,
        rdzv_id=rdzv_id,
        min_nodes=scenario.min_nodes,
        max_nodes=scenario.max_nodes,
        max_restarts=scenario.max_restarts,
        nproc_per_node=scenario.nproc_per_node,
        rendezvous=scenario.rendezvous,
    )
    policy.validate()
    return policy


def check_out_dir(out: Path) -> Path:
    """``out`` if it is new or empty: appending to another run's logs would mix two runs."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise LabError(f"--out: {out} already exists and is not empty; choose a new directory")
    return out


@contextmanager
def lab_workspace() -> Iterator[Path]:
    """The session's temp dir. On exit, every process of ours that still mentions it (in
    its env or command line: a node's TMPDIR, etcd's data dir) is killed first, and only
    then is the dir removed: nothing is left running with its files gone."""
    # Orphans of a killed agent re-parent to us, so the sweep finds them as descendants.
    process_tree.become_subreaper()
    with tempfile.TemporaryDirectory(prefix="spot-lab-") as work_dir:
        try:
            yield Path(work_dir)
        finally:
            process_tree.kill_marked_descendants(work_dir + os.sep)


@contextmanager
def created_for_setup(out: Path) -> Iterator[Path]:
    """Create ``out`` (and missing parents); if the block fails, remove what was created."""
    top = out
    while not top.parent.exists() and top.parent != top:
        top = top.parent
    existed = out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise LabError(f"--out: cannot create {out}: {err.strerror or err}") from None
    try:
        yield out
    except BaseException:
        if existed:  # check_out_dir let only an empty dir through: empty it again
            for child in out.iterdir():
                if child.is_dir():
                    shutil.rmtree(child)
                else:
                    child.unlink()
        else:
            shutil.rmtree(top, ignore_errors=True)
        raise


def run_session(
    scenario: Scenario, options: SessionOptions, status: StatusLine | None
) -> dict[str, Any]:
    """Run ``scenario`` end to end; the report (also written to ``options.out_dir``).

    A first SIGINT/SIGTERM/SIGHUP ends the run as ``interrupted``; any signal after that,
    or during the cleanup, waits until the cleanup is done and the report is written.
    """
    plan = validate_scenario(scenario)
    binary = find_etcd_binary(options.etcd_binary)
    data_dir = check_data_dir(options.data_dir, scenario.train) if options.data_dir else None
    out = check_out_dir(options.out_dir)
    # redeliver: a library caller's own handler decides what a signal means, once we are done.
    with interrupt_guard(redeliver=True) as guard:
        outcome = _run_in_workspace(scenario, plan, options, binary, data_dir, status, guard)
        return write_report(outcome, out)


def _run_in_workspace(
    scenario: Scenario,
    plan: list[MembershipChange],
    options: SessionOptions,
    binary: Path,
    data_dir: Path | None,
    status: StatusLine | None,
    guard: InterruptGuard,
) -> RunOutcome:
    """Set up etcd and the nodes in a fresh workspace, run the scenario, stop everything."""
    out = options.out_dir
    # Exits in reverse: nodes stop, etcd stops, leftover processes die, the temp dir goes.
    with lab_workspace() as work, ExitStack() as stack:
        with created_for_setup(out):
            (out / "scenario.json").write_text(json.dumps(dataclasses.asdict(scenario), indent=2))
            data_dir = data_dir or write_dataset(work / "data", scenario, options.python)
            etcd = stack.enter_context(EmbeddedEtcd(binary, work / "etcd-data", out / "etcd.log"))
        # A fresh id for every run: a rendezvous closed by an orderly shutdown stays closed.
        policy = _policy(scenario, etcd.client_port, f"lab-{uuid.uuid4().hex[:12]}")
        lab_log = LabEventLog(out / "lab-events.jsonl")
        lab_log.write(
            "session_started",
            workspace=str(work),
            etcd=etcd.client_url,
            rdzv_id=policy.rdzv_id,
            data_dir=str(data_dir),
        )
        nodes = stack.enter_context(
            NodeSet(scenario, policy, work, out / "nodes", data_dir, options.python)
        )
        runner = FaultRunner(
            scenario,
            plan,
            nodes.make,
            etcd,
            lab_log,
            status,
            extend_run=lambda steps: write_max_steps(nodes.max_steps_file, steps),
        )
        try:
            return runner.run()
        finally:
            guard.defer()  # the cleanup starts here and must not be cut short
            if status is not None:
                status.close()


def write_report(outcome: RunOutcome, out: Path) -> dict[str, Any]:
    """Build the report from the logs in ``out`` (as ``lab report --logs`` would) and write
    report.json, report.txt and timeline.png."""
    run = load_lab_run(out)
    report = report_from_run(run)  # the lab's details too: lab report --logs gives the same
    report["outcome"] = {"status": outcome.status, "message": outcome.message}
    write_outputs(out, run, report)
    return report
