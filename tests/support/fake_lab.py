"""The local lab's runner against fake nodes: a fake job stands in for torchrun (the lowest-numbered
running node is rank 0 and logs one metrics line per poll; a membership change logs a
``resumed`` event), with a fake etcd, and a scenario of three nodes to change."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from lab.live.event_log import LabEventLog
from lab.local.runner import FaultRunner
from lab.local.scenario import Fault, Scenario, TrainSettings, validate_scenario
from training.records import EVENT, FINISHED, METRICS, RESUMED


class FakeJob:
    def __init__(self, log_dir: Path, max_steps: int) -> None:
        self.log_dir, self.max_steps = log_dir, max_steps
        self.nodes: dict[int, FakeNode] = {}
        self.calls: list[tuple[str, str]] = []
        self.members: tuple[int, ...] = ()
        self.step = 0
        self.ts = 0.0

    def clock(self) -> float:
        return self.ts

    def write(self, node: FakeNode, **record) -> None:
        with open(node.stdout_path, "a") as handle:
            handle.write(json.dumps({"ts": self.ts, "rank": 0, **record}) + "\n")

    def tick(self) -> None:
        self.ts += 0.1
        running = tuple(n for n, node in sorted(self.nodes.items()) if node.trains())
        if not running:
            return
        rank0 = self.nodes[running[0]]
        if running != self.members:
            self.members = running
            self.write(rank0, kind=EVENT, event=RESUMED, step=self.step, world_size=len(running))
            return
        self.step += 1
        self.write(rank0, kind=METRICS, step=self.step, world_size=len(running), loss=1.0)
        if self.step >= self.max_steps:
            self.write(rank0, kind=EVENT, event=FINISHED, step=self.step)
            for node in self.nodes.values():
                if node.trains():
                    node.exit(0)


@dataclasses.dataclass
class FakeNode:
    job: FakeJob
    number: int
    running: bool = False
    frozen: bool = False
    code: int | None = None
    starts: int = 0

    @property
    def name(self) -> str:
        return f"node-{self.number}"

    @property
    def stdout_path(self) -> Path:
        return self.job.log_dir / f"{self.name}.jsonl"

    @property
    def stderr_path(self) -> Path:
        return self.job.log_dir / f"{self.name}.log"

    def trains(self) -> bool:
        return self.running and not self.frozen

    def exit(self, code: int) -> None:
        self.running, self.code = False, code

    def start(self) -> None:
        self.running, self.frozen, self.code = True, False, None
        self.starts += 1
        self.job.calls.append(("start", self.name))
        self.say_first_word()

    def say_first_word(self) -> None:
        """torchrun's first line, once Python and torch are loaded."""
        with open(self.stderr_path, "a") as handle:
            handle.write(f"{self.name}: Using nproc_per_node=1.\n")

    def poll(self) -> int | None:
        if self.number == min(
            (n for n, node in self.job.nodes.items() if node.trains()), default=-1
        ):
            self.job.tick()  # one tick per runner loop: only the first training node ticks
        return None if self.running else self.code

    def kill(self) -> None:
        self.job.calls.append(("kill", self.name))
        self.exit(-9)

    def notify_eviction(self) -> None:
        self.job.calls.append(("sigterm", self.name))
        self.exit(75)

    def freeze(self) -> None:
        self.job.calls.append(("freeze", self.name))
        self.frozen = True

    def terminate(self, grace_s: float) -> None:
        self.exit(-15)


class FakeEtcd:
    def __init__(self, job: FakeJob) -> None:
        self.job = job

    def restart(self, down_s: float = 0.0, wipe_data: bool = False) -> None:
        self.job.calls.append(("etcd-restart", f"down={down_s} wipe={wipe_data}"))


def _scenario(*faults: Fault, **overrides) -> Scenario:
    base = Scenario(
        name="fake",
        nodes=3,
        min_nodes=1,
        max_nodes=3,
        restart_delay_s=0.0,
        timeout_s=20,
        train=TrainSettings(max_steps=200),
        faults=faults,
    )
    return dataclasses.replace(base, **overrides)


def _runner(
    tmp_path: Path, scenario: Scenario, extendable: bool = False
) -> tuple[FaultRunner, FakeJob]:
    """``extendable``: the fake job's end moves when the runner extends the run, as the
    training's does through --max-steps-file."""
    job = FakeJob(tmp_path, scenario.train.max_steps)

    def make_node(number: int) -> FakeNode:
        job.nodes[number] = FakeNode(job, number)
        return job.nodes[number]

    runner = FaultRunner(
        scenario,
        validate_scenario(scenario),
        make_node,
        FakeEtcd(job),
        LabEventLog(tmp_path / "lab-events.jsonl", clock=job.clock),
        status=None,
        extend_run=(lambda steps: setattr(job, "max_steps", steps)) if extendable else None,
        settle_lines=2,
        poll_s=0.0,
        finish_grace_s=1.0,
        clock=job.clock,
    )
    return runner, job
