"""The invariants a chaos schedule must keep, checked on what it left behind (pure).

- **finished**: the job trained to ``max_steps``; no agent ended for good (a code the operator
  does not retry) while the job could run (the runner always brings the capacity back). A
  node that started as training finished and found the rendezvous closed ends as the run did.
- **no lost step**: every round resumed at or after the newest step any group completed
  before it (in any node's log: rank 0's metrics, every node's saves and completed steps),
  unless every node that held that step lost it (a node of the group that completed it, but
  not one whose own save on its stop says it had an older step): killed or frozen with no
  notice (a SIGKILL
  takes the node's disk, the state in memory and the steps since the last durable save with
  it), or evicted while the store, as its calls were measured in that schedule, left no
  room for a commit in the whole deadline (``bench/chaos/store_excuse.py``).
  Those are listed as excused, with the reason, never silently.
- **one group**: no two rendezvous rounds trained at once (``lab/report/outcomes.py``), a
  thawed node's old round included.
- **ranks**: every round that trained a step had every rank of its world, once, each node
  with its ``nproc_per_node`` processes (local ranks 0 to nproc-1, rank = the node's group
  rank x nproc + the local rank).
- **durable not behind**: at every acknowledgement of a durable step (a periodic save, an
  eviction's commit, the final one), the store's newest checkpoint that verifies was at least
  that step, and never older than at an earlier acknowledgement (a thawed writer's late
  upload must not move the head back); and at the end too.
- **trajectory**: the final parameters equal an uninterrupted run's (float64, within
  ``TOLERANCE``).
- **exit codes**: every agent's code is the one ENDINGS gives for its ending: SIGKILL for a
  node the campaign killed or froze, SIGTERM's for one it evicted, else what the agent says;
  a frozen node that came back (SIGCONT) is judged by what it did after, as one the campaign
  never touched: it may rejoin and train on, or end as the table says for what it reports,
  but not for good while the job runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from bench.chaos.endings import (
    CLOSED_ENDING,
    FINISHED_ENDING,
    SIGKILL_ENDING,
    SIGTERM_ENDING,
    ending,
    exit_code,
    log_lines_between,
    reported,
    signal_name,
)
from bench.chaos.store_excuse import store_refused
from lab.report.outcomes import groups_at_once
from training.records import (
    EMERGENCY_SAVE,
    FINISHED,
    METRICS,
    RESUMED,
    STARTED,
    Record,
    acknowledged_step,
    completed_step,
)

TOLERANCE = 1e-9
"""float64 runs at world sizes 1-3 agree to ~1e-15; one step more or less moves ~1e-3 (the
end-to-end tests' bound, tests/test_elastic_training.py)."""
TERM, KILL, STOP, CONT = "SIGTERM", "SIGKILL", "SIGSTOP", "SIGCONT"
SIGNALS_OF = {
    "evict": TERM,
    "evict-all": TERM,
    "sigterm-restore": TERM,
    "sigterm-upload": TERM,
    "kill": KILL,
    "freeze": STOP,
    "thaw": STOP,
    "thaw-upload": STOP,
    "thawed": CONT,
}
INVARIANTS = (
    "finished",
    "no lost step",
    "one group",
    "ranks",
    "durable not behind",
    "trajectory",
    "exit codes",
)


@dataclass
class Process:
    """One agent process of one node (a node restarted in place has several)."""

    node: str
    started: float
    ended: float | None = None
    code: int | None = None
    signals: list[tuple[float, str]] = field(default_factory=list)
    """What the campaign sent it: (time, SIGTERM | SIGKILL | SIGSTOP)."""


@dataclass(frozen=True)
class Evidence:
    """Everything a schedule left behind."""

    records: list[Record]
    lab_events: list[dict[str, Any]]
    actions: list[dict[str, Any]]
    final_codes: dict[str, int | None]
    agent_logs: dict[str, str]
    ack_checks: list[dict[str, Any]]
    newest_verified: int | None
    parameter_difference: float | None
    status: str
    max_steps: int
    stop_deadline_s: float
    nproc_per_node: int = 1
    store_calls: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    """Each node's log of its durable store's calls (bench/chaos/faulty_store.py)."""


@dataclass
class Verdict:
    violations: list[dict[str, str]] = field(default_factory=list)
    excused: list[dict[str, str]] = field(default_factory=list)

    def violate(self, invariant: str, detail: str) -> None:
        self.violations.append({"invariant": invariant, "detail": detail})

    def excuse(self, invariant: str, detail: str) -> None:
        self.excused.append({"invariant": invariant, "detail": detail})


def signals_by_node(actions: list[dict[str, Any]]) -> dict[str, list[tuple[float, str]]]:
    """Each node's signals from the campaign, in time order."""
    found: dict[str, list[tuple[float, str]]] = {}
    for action in actions:
        sig = SIGNALS_OF.get(action["kind"])
        if sig is None or action.get("landed") is False or action.get("armed"):
            continue
        for node in action["nodes"]:
            found.setdefault(node, []).append((action["ts"], sig))
    return {node: sorted(sigs) for node, sigs in found.items()}


def processes(evidence: Evidence) -> list[Process]:
    """Every agent process, from the lab's event log; the last one's code from the end."""
    by_node: dict[str, list[Process]] = {}
    for event in sorted(evidence.lab_events, key=lambda e: e["ts"]):
        mine = by_node.setdefault(event.get("node", ""), [])
        if event["event"] == "node_started":
            mine.append(Process(event["node"], event["ts"]))
        elif event["event"] == "node_exited" and mine and mine[-1].ended is None:
            mine[-1].ended, mine[-1].code = event["ts"], event["code"]
    signals = signals_by_node(evidence.actions)
    found = []
    for node, procs in by_node.items():
        for i, proc in enumerate(procs):
            if proc.ended is None and i == len(procs) - 1:
                proc.code = evidence.final_codes.get(node)
            until = proc.ended if proc.ended is not None else float("inf")
            proc.signals = [s for s in signals.get(node, []) if proc.started <= s[0] <= until]
            found.append(proc)
    return found


def check_exit_codes(evidence: Evidence, verdict: Verdict) -> None:
    finished_at = min(
        (r["ts"] for r in evidence.records if r.get("event") == FINISHED), default=None
    )
    finished = finished_at is not None
    for proc in processes(evidence):
        if proc.code is None:
            verdict.violate("exit codes", f"{proc.node} had not exited when the run ended")
            continue
        code = exit_code(proc.code)
        sent = [sig for _, sig in proc.signals]
        if CONT in sent:  # a paused VM that came back: what it did after is its own
            sent = sent[len(sent) - sent[::-1].index(CONT) :]
        if sent and sent[0] in (KILL, STOP):
            how: str | None = SIGKILL_ENDING
        elif sent:  # evicted: its own code, or SIGKILL when its grace ran out
            how = SIGKILL_ENDING if code == 137 else SIGTERM_ENDING
        elif code == 0:
            how = FINISHED_ENDING
            if not finished:
                verdict.violate("exit codes", f"{proc.node} exited 0 before training finished")
        else:
            text = evidence.agent_logs.get(proc.node, "")
            until = proc.ended if proc.ended is not None else float("inf")
            how = reported(log_lines_between(text, proc.started, until))
        if how is None:
            verdict.violate(
                "exit codes", f"{proc.node} exited {code} ({signal_name(code)}) saying no ending"
            )
            continue
        row = ending(how)
        if row.code != code:
            verdict.violate(
                "exit codes", f"{proc.node}: {how!r} exited {code}, the table says {row.code}"
            )
        # A node that came as training finished finds the run over: the job's end, not its.
        late = how == CLOSED_ENDING and finished_at is not None and (proc.ended or 0) >= finished_at
        if not sent and not row.retried and how != FINISHED_ENDING and not late:
            verdict.violate("finished", f"{proc.node} ended for good ({how}, {code})")


def _completions(records: list[Record]) -> list[Record]:
    """Records that show a step completed, in any node's log (``completed_step``: rank 0's
    metrics, saves, and the line every other node logs at a log step), so a step is counted
    from every node's own log, not only from the survivors' own word at the next resume."""
    return [r for r in records if completed_step(r) is not None]


def _holders(records: list[Record], first: Record) -> dict[str, float]:
    """The nodes of the group that completed the step ``first`` shows, each with when its
    worker started in that group; not a node whose own save on its stop, in that group, says
    it had an older step. Under DDP one node's ranks may apply a step whose all-reduce another
    node's, stopped in it, never finished (the campaign's seeds 5 and 28 on d1be122)."""
    group, best, found, behind = first.get("rdzv_round"), int(first["step"]), {}, set()
    for r in records:
        if group and r.get("rdzv_round") == group:
            found.setdefault(r["node"], r["ts"])
            if r.get("event") == EMERGENCY_SAVE and int(r["step"]) < best:
                behind.add(r["node"])
    return {node: ts for node, ts in found.items() if node not in behind}


def _fate(
    node: str, since: float, until: float, evidence: Evidence, sigs: list
) -> tuple[str | None, str]:
    """How ``node`` lost its copy of a step between ``since`` and ``until`` (None if not),
    and a note on it for a violation."""
    mine = [(ts, sig) for ts, sig in sigs if since <= ts <= until and sig != CONT]
    if not mine:
        return None, node
    ts, sig = mine[0]
    if sig in (KILL, STOP):
        return f"{node} got {sig} with no notice", node
    refused, why = store_refused(
        ts, ts + evidence.stop_deadline_s, evidence.actions, evidence.store_calls, node
    )
    if refused:
        return (
            f"{node} was evicted while the store, failing and slowed, left no room for a "
            f"commit in its whole deadline ({why})"
        ), node
    return None, f"{node} (evicted; the store: {why})"


def _trained(records: list[Record], resumed: Record) -> bool:
    """Whether the round that ``resumed`` started trained a step (else it redid nothing)."""
    group = resumed.get("rdzv_round")
    return any(r["kind"] == METRICS and r.get("rdzv_round") == group for r in records)


def check_lost_steps(evidence: Evidence, verdict: Verdict, sigs: dict[str, list]) -> int:
    """The no-lost-step invariant; the steps lost in all (excused ones included)."""
    records, lost_total = evidence.records, 0
    completions = _completions(records)
    for resumed in (r for r in records if r.get("event") == RESUMED):
        before = [c for c in completions if c["ts"] < resumed["ts"]]
        best = max((int(c["step"]) for c in before), default=-1)
        if int(resumed["step"]) >= best or not _trained(records, resumed):
            continue
        lost_total += best - int(resumed["step"])
        first = next(c for c in before if int(c["step"]) == best)
        fated = {
            node: _fate(node, since, resumed["ts"], evidence, sigs.get(node, []))
            for node, since in _holders(records, first).items()
        }
        what = (
            f"round {resumed.get('rdzv_round')} resumed at step {resumed['step']} "
            f"({resumed['source']}) after step {best} was completed"
        )
        fates = {node: fate for node, (fate, _) in fated.items()}
        if fates and all(fates.values()):
            lost = "; ".join(str(f) for f in fates.values())
            verdict.excuse("no lost step", f"{what}; every node that held it was lost: {lost}")
        else:
            kept = sorted(note for fate, note in fated.values() if fate is None)
            kept = kept or ["no node known"]
            verdict.violate("no lost step", f"{what}; held by {', '.join(kept)}")
    return lost_total


def check_ranks(evidence: Evidence, verdict: Verdict) -> None:
    """Every round that trained a step: its world, rank by rank, node by node."""
    nproc, records = evidence.nproc_per_node, evidence.records
    trained = {r.get("rdzv_round") for r in records if r["kind"] == METRICS}
    for round_ in sorted(r for r in trained if r is not None):
        started = [r for r in records if r.get("event") == STARTED and r["rdzv_round"] == round_]
        worlds = {r["world_size"] for r in started}
        ranks = sorted(r["rank"] for r in started)
        nodes: dict[str, list[int]] = {}
        for r in started:
            nodes.setdefault(r["node"], []).append(r["local_rank"])
            if r["rank"] != r["group_rank"] * nproc + r["local_rank"]:
                verdict.violate("ranks", f"round {round_}: {r['node']} rank {r['rank']} is off")
        wrong = {n: sorted(lr) for n, lr in nodes.items() if sorted(lr) != list(range(nproc))}
        world = worlds.pop() if len(worlds) == 1 else None
        if world is None or ranks != list(range(world)) or world != nproc * len(nodes) or wrong:
            verdict.violate(
                "ranks",
                f"round {round_} trained with world sizes {sorted({*worlds, world} - {None})}, "
                f"ranks {ranks}, local ranks {wrong or 'right'} on {len(nodes)} nodes of {nproc}",
            )


def check_durable(evidence: Evidence, verdict: Verdict) -> None:
    head: tuple[int, str] | None = None
    for check in sorted(evidence.ack_checks, key=lambda c: c["ts"]):
        if check["verified"] is None or check["verified"] < check["acked"]:
            verdict.violate(
                "durable not behind",
                f"step {check['acked']} acknowledged ({check['node']}), newest that verifies: "
                f"{check['verified']}",
            )
        found = check["verified"] if check["verified"] is not None else -1
        if head is not None and found < head[0]:
            verdict.violate(
                "durable not behind",
                f"the newest checkpoint that verifies went back from step {head[0]} "
                f"({head[1]}'s acknowledgement) to {check['verified']} ({check['node']}'s)",
            )
        if head is None or found >= head[0]:
            head = (found, check["node"])
    acked = [s for r in evidence.records if (s := acknowledged_step(r)) is not None]
    if acked and (evidence.newest_verified is None or evidence.newest_verified < max(acked)):
        verdict.violate(
            "durable not behind",
            f"at the end: step {max(acked)} acknowledged, newest that verifies: "
            f"{evidence.newest_verified}",
        )


def check(evidence: Evidence) -> tuple[Verdict, dict[str, Any]]:
    """Every invariant; the verdict and the schedule's figures."""
    verdict = Verdict()
    if evidence.status != "finished":
        verdict.violate("finished", f"the run ended {evidence.status}")
    check_exit_codes(evidence, verdict)
    sigs = signals_by_node(evidence.actions)
    lost = check_lost_steps(evidence, verdict, sigs)
    for pair in groups_at_once(evidence.records):
        verdict.violate("one group", f"rounds {pair['rounds']} trained at once from {pair['from']}")
    check_ranks(evidence, verdict)
    check_durable(evidence, verdict)
    if evidence.status == "finished":
        diff = evidence.parameter_difference
        if diff is None or diff > TOLERANCE:
            verdict.violate("trajectory", f"final parameters differ by {diff} (> {TOLERANCE})")
    return verdict, {"steps_lost": lost, "worst_pause_s": worst_pause(evidence)}


def worst_pause(evidence: Evidence) -> float | None:
    """The longest time without an optimiser step from the first fault to the end."""
    start = next((a["ts"] for a in evidence.actions if a["kind"] == "warm"), None)
    if start is None:
        return None
    times = sorted(r["ts"] for r in evidence.records if r["kind"] == METRICS and r["ts"] >= start)
    times = [start, *times]
    return round(max((b - a for a, b in zip(times, times[1:], strict=False)), default=0.0), 2)
