"""The runner: turns a Scenario into node processes and injects its faults.

One loop, polled every ``poll_s``: read the nodes' new JSON lines, react to nodes that
exited, run due follow-ups (the SIGKILL after an eviction's grace period, a restart by the
"kubelet"), inject the next fault when it is due and the job has settled after the
previous one, and stop when the training program reports ``finished``. Everything the lab
does is written to its own event log, which the report reads next to the node logs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from lab.live.event_log import LabEventLog
from lab.live.job_view import JobView
from lab.live.status_line import StatusLine, status_text
from lab.local.node import NodeProcess, logged_bytes, wait_for_exit, wait_for_first_word
from lab.local.run_extension import StepRate, extended_end, margin_steps
from lab.local.scenario import Fault, MembershipChange, Scenario
from lab.report.node_logs import LogTail
from training.elastic.exit_codes import BAD_INPUT
from training.records import Record, parse

# A pod that keeps failing is in CrashLoopBackOff; the lab gives up instead of looping.
MAX_RESTARTS_IN_PLACE = 5


class Rendezvous(Protocol):
    """The part of the embedded etcd the runner uses."""

    def restart(self, down_s: float = 0.0, wipe_data: bool = False) -> None:
        """Stop, stay down ``down_s`` seconds, start again on the same port."""


@dataclass
class RunOutcome:
    """How the run ended (``finished``, ``settled``, ``failed``, ``timeout`` or ``interrupted``)
    and why."""

    status: str
    message: str
    start_ts: float
    injected: int


@dataclass
class _FollowUp:
    due: float
    action: str  # "kill" or "restart"
    node: int


def _tail_text(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return ""


@dataclass
class FaultRunner:
    """Runs one scenario against live nodes; ``run()`` returns when training ends."""

    scenario: Scenario
    plan: list[MembershipChange]
    make_node: Callable[[int], NodeProcess]
    rendezvous: Rendezvous
    lab_log: LabEventLog
    status: StatusLine | None = None
    extend_run: Callable[[int], None] | None = None
    """Moves the training's end to the given step (None: the end never moves)."""
    settle_lines: int = 3
    poll_s: float = 0.2
    finish_grace_s: float = 30.0
    """After ``finished``: how long all agents together get to exit on their own."""
    clock: Callable[[], float] = time.time
    nodes: dict[int, NodeProcess] = field(default_factory=dict)
    live: set[int] = field(default_factory=set)
    view: JobView = field(default_factory=JobView)
    _tails: dict[int, LogTail] = field(default_factory=dict)
    _logged_at_start: dict[int, int] = field(default_factory=dict)
    _follow_ups: list[_FollowUp] = field(default_factory=list)
    _frozen: list[int] = field(default_factory=list)
    _restarts: dict[int, int] = field(default_factory=dict)
    _next_fault: int = 0
    _settle_world: int | None = None
    _injected_mono: float = 0.0
    _injected_at: float = 0.0
    _quiet_until: float = 0.0
    _start_ts: float = 0.0
    _late_from_step: int | None = None
    """The step at which the next fault was due while the job had not settled yet."""
    _pace: StepRate = field(default_factory=StepRate)
    _end: int = 0
    """The step the training stops at: max_steps, or later once the lab extended the run."""

    def run(self) -> RunOutcome:
        """Start the nodes, inject every fault, wait for the end; nodes still run after.

        Ctrl-C ends the run as ``interrupted``: the caller still stops the nodes and
        writes the report of what happened so far.
        """
        self._start_ts = self.clock()
        self._end = self.scenario.train.max_steps
        try:
            return self._loop()
        except KeyboardInterrupt:
            return self._outcome("interrupted", "interrupted by a signal")

    def _loop(self) -> RunOutcome:
        self.lab_log.write("run_started", scenario=self.scenario.name)
        for number in range(self.scenario.nodes):
            self._start_node(number)
        self._settle_world = self.scenario.nodes * self.scenario.nproc_per_node
        deadline = time.monotonic() + self.scenario.timeout_s
        while True:
            self._read_logs()
            failure = self._check_nodes()
            if failure:
                return self._outcome("failed", failure)
            self._run_follow_ups()
            self._settle()
            stalled = self._unsettled_too_long()
            if stalled:
                return self._outcome("timeout", stalled)
            if self.scenario.stop_when_settled and self._all_faults_settled():
                return self._outcome("settled", f"the last fault settled at step {self.view.step}")
            self._maybe_inject()
            self._keep_the_end_ahead()
            if not self.live and not self._nodes_expected():
                self._read_logs()  # the last lines may land just before the agents exit
                if not self.view.finished:
                    return self._outcome("failed", "every node exited before training finished")
            if self.view.finished:
                return self._finish()
            if time.monotonic() > deadline:
                return self._outcome("timeout", f"not finished after {self.scenario.timeout_s} s")
            self._show_status()
            time.sleep(self.poll_s)

    # -- nodes ------------------------------------------------------------------------------
    def _start_node(self, number: int) -> None:
        node = self.nodes.get(number) or self.make_node(number)
        self.nodes[number] = node
        self._tails.setdefault(number, LogTail(node.stdout_path))
        self._logged_at_start[number] = logged_bytes(node)
        node.start()
        self.live.add(number)
        self.lab_log.write("node_started", node=node.name)

    def _read_logs(self) -> None:
        for number, tail in self._tails.items():
            for line in tail.read_lines():
                record = parse(line, self.nodes[number].name)
                if record is not None:
                    self._observe(number, record)

    def _observe(self, number: int, record: Record) -> None:
        """One new record of node ``number``, as it arrives."""
        self.view.observe(record)

    def _check_nodes(self) -> str | None:
        """React to nodes that exited on their own; a message when the run cannot go on."""
        for number in sorted(self.live):
            node = self.nodes[number]
            code = node.poll()
            if code is None:
                continue
            self.live.discard(number)
            self.lab_log.write("node_exited", node=node.name, code=code)
            if code == 0:
                continue
            stderr = _tail_text(node.stderr_path)
            if code == BAD_INPUT:
                return f"{node.name} exited with code 2 (bad input):\n{stderr}"
            if "RendezvousClosedError" in stderr:
                return f"{node.name}: the rendezvous is closed for good:\n{stderr}"
            if self.scenario.restart_policy == "Never":
                self._message(f"{node.name} exited with code {code}; restart_policy is Never")
                continue
            self._restarts[number] = self._restarts.get(number, 0) + 1
            if self._restarts[number] > MAX_RESTARTS_IN_PLACE:
                return f"{node.name} failed {MAX_RESTARTS_IN_PLACE} times in place:\n{stderr}"
            self._message(f"{node.name} exited with code {code}; restarting it in place")
            due = time.monotonic() + self.scenario.restart_delay_s
            self._follow_ups.append(_FollowUp(due, "restart", number))
        return None

    def _nodes_expected(self) -> bool:
        """Whether a node will start again although none runs now (a restart is due)."""
        return any(f.action == "restart" for f in self._follow_ups)

    def _run_follow_ups(self) -> None:
        now = time.monotonic()
        for follow_up in [f for f in self._follow_ups if f.due <= now]:
            self._follow_ups.remove(follow_up)
            if follow_up.action == "restart":
                self._start_node(follow_up.node)
                self.lab_log.write("node_restarted", node=self.nodes[follow_up.node].name)
            else:
                self.nodes[follow_up.node].kill()

    # -- faults -----------------------------------------------------------------------------
    def _settle(self) -> None:
        if self._settle_world is None:
            return
        restarting = any(f.action == "restart" for f in self._follow_ups)
        if restarting or not self.view.settled(self._settle_world, self.settle_lines):
            return
        if self._etcd_restart_pending():
            return
        self._settle_world = None
        for number in self._frozen:  # the vanished VM is finally deleted
            self.nodes[number].kill()
        self._frozen.clear()
        if self._next_fault:
            self.lab_log.write("fault_settled", index=self._next_fault - 1)

    def _etcd_restart_pending(self) -> bool:
        """After an etcd restart, lines at the same world size prove nothing yet: an agent
        may still find a heartbeat lost while etcd was down and restart every worker. It
        has settled once a round resumed after the restart, or once the keep-alive bound
        (interval x max attempts) passed without one: the agents rode it out."""
        last = self.scenario.faults[self._next_fault - 1] if self._next_fault else None
        if last is None or last.kind != "etcd-restart":
            return False
        resumed = self.view.resumed_ts >= self._injected_at
        return not resumed and self.clock() < self._quiet_until

    def _all_faults_settled(self) -> bool:
        faults = len(self.scenario.faults)
        return faults > 0 and self._next_fault == faults and self._settle_world is None

    def _unsettled_too_long(self) -> str | None:
        """A message once the last fault has not settled within ``settle_timeout_s``."""
        limit = self.scenario.settle_timeout_s
        if limit is None or self._settle_world is None or not self._next_fault:
            return None
        if time.monotonic() - self._injected_mono < limit:
            return None
        index = self._next_fault - 1
        described = self.scenario.faults[index].describe()
        return f"fault {index} ({described}) did not settle within {limit:g} s"

    def _due(self, fault: Fault) -> bool:
        if fault.at_step is not None:
            return self.view.step >= fault.at_step
        return self.clock() - self._start_ts >= (fault.at_time or 0.0)

    def _maybe_inject(self) -> None:
        if self._next_fault >= len(self.scenario.faults):
            return
        fault = self.scenario.faults[self._next_fault]
        if not self._due(fault):
            return
        if self._settle_world is not None:  # due, but the job has not settled: it fires late
            if self._late_from_step is None:
                self._late_from_step = self.view.step
            return
        change = self.plan[self._next_fault]
        self._message(f"fault {self._next_fault}: {fault.describe()}")
        injected_at = self.clock()
        self._injected_at, self._injected_mono = injected_at, time.monotonic()
        self._inject(fault, change)
        rendezvous = self.scenario.rendezvous
        keep_alive_s = rendezvous.keep_alive_interval_s * rendezvous.keep_alive_max_attempt
        self._quiet_until = self.clock() + keep_alive_s  # from when etcd is back
        self.lab_log.write(
            "fault_injected",
            index=self._next_fault,
            kind=fault.kind,
            description=fault.describe(),
            injected_at=injected_at,
            step_at_injection=self.view.step,
            late_from_step=self._late_from_step,
            world_size_at_injection=self.view.world_size,
            planned_world_size=change.world_size,
            stopped=[self.nodes[n].name for n in change.stopped],
            started=[self.nodes[n].name for n in change.started],
        )
        self._next_fault += 1
        self._settle_world, self._late_from_step = change.world_size, None
        # Lines logged while the fault was still being injected prove nothing.
        self.view.reset(self.clock())

    def _faults_remain(self) -> bool:
        """A fault is still to be injected, or the last one injected is still to settle."""
        injected_unsettled = self._next_fault > 0 and self._settle_world is not None
        return self._next_fault < len(self.scenario.faults) or injected_unsettled

    def _waiting_for(self) -> str:
        if self._next_fault > 0 and self._settle_world is not None:
            index = self._next_fault - 1
            return f"fault {index} ({self.scenario.faults[index].describe()}) to settle"
        index = self._next_fault
        return f"fault {index} ({self.scenario.faults[index].describe()})"

    def _keep_the_end_ahead(self) -> None:
        """Extend the run while faults remain and the job nears its end (run_extension.py)."""
        if self.extend_run is None:
            return
        pace = self._pace.observe(self.clock(), self.view.step)
        margin = margin_steps(pace)
        new_end = extended_end(self._end, self.view.step, self._faults_remain(), margin)
        if new_end is None:
            return
        self.extend_run(new_end)
        waiting_for = self._waiting_for()
        self.lab_log.write(
            "run_extended",
            max_steps=new_end,
            previous_max_steps=self._end,
            step=self.view.step,
            margin=margin,
            waiting_for=waiting_for,
        )
        self._message(f"the run is extended to step {new_end}: waiting for {waiting_for}")
        self._end = new_end

    def _inject(self, fault: Fault, change: MembershipChange) -> None:
        for number in change.stopped:
            self.live.discard(number)
            node = self.nodes[number]
            if fault.kind == "evict":
                node.notify_eviction()
                due = time.monotonic() + fault.grace_s
                self._follow_ups.append(_FollowUp(due, "kill", number))
            elif fault.kind == "freeze":
                node.freeze()
                self._frozen.append(number)
            else:
                node.kill()
        self._follow_ups = [
            f for f in self._follow_ups if not (f.action == "restart" and f.node in change.stopped)
        ]
        if fault.kind == "etcd-restart":
            self.rendezvous.restart(down_s=fault.down_s, wipe_data=fault.wipe_data)
        for number in change.started:
            self._start_node(number)

    # -- the end ----------------------------------------------------------------------------
    def _finish(self) -> RunOutcome:
        """Training finished: give the agents ``finish_grace_s`` in all to leave their exit
        barrier; the session stops any that are still there (and the log says which). A node
        still starting (silent since its start: a cold start on a loaded machine) gets its
        grace from its first line, for which it waits up to the scenario's timeout."""
        for follow_up in [f for f in self._follow_ups if f.action == "kill"]:
            self.nodes[follow_up.node].kill()
        self._follow_ups.clear()
        deadline = time.monotonic() + self.finish_grace_s
        for number in sorted(self.live):
            node = self.nodes[number]
            if logged_bytes(node) <= self._logged_at_start[number]:
                wait_for_first_word(node, self._logged_at_start[number], self.scenario.timeout_s)
                deadline = max(deadline, time.monotonic() + self.finish_grace_s)
            code = wait_for_exit(node, max(deadline - time.monotonic(), 0.0))
            if code is None:
                self._message(f"{node.name} still runs {self.finish_grace_s:g} s after the end")
            self.lab_log.write(
                "node_exited" if code is not None else "node_lingered", node=node.name, code=code
            )
        self._read_logs()
        self.live.clear()
        message = f"training finished at step {self.view.step}"
        missed = [
            f"{index} ({fault.describe()})"
            for index, fault in enumerate(self.scenario.faults)
            if index >= self._next_fault
        ]
        if missed:
            message += f" before these faults were injected: {', '.join(missed)}"
        elif self._end > self.scenario.train.max_steps:
            message += (
                f" (extended from {self.scenario.train.max_steps}: faults fell behind the schedule)"
            )
        return self._outcome("finished", message)

    def _outcome(self, status: str, message: str) -> RunOutcome:
        self.lab_log.write("run_ended", status=status, message=message)
        return RunOutcome(status, message, self._start_ts, self._next_fault)

    def _message(self, text: str) -> None:
        elapsed = self.clock() - self._start_ts
        if self.status is not None:
            self.status.message(f"[{elapsed:7.1f}s] {text}")

    def _show_status(self) -> None:
        if self.status is None:
            return
        if self._settle_world is not None:
            note = f"waiting for world size {self._settle_world}"
        elif self._next_fault < len(self.scenario.faults):
            note = f"next: {self.scenario.faults[self._next_fault].describe()}"
        else:
            note = "no more faults"
        elapsed = self.clock() - self._start_ts
        self.status.update(status_text(elapsed, self.view, self._end, note))
