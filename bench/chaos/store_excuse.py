"""Whether the store, as measured in one schedule, left an evicted node no room to commit (pure).

The faulty store logs every call of every node (bench/chaos/faulty_store.py: start,
duration, the delay injected, the outcome). A step lost to an eviction is excused only when the
calls measured in its stop deadline show that no commit could have fitted:

- a commit costs what the schedule's own **healthy commits** took (those whose every call met
  no injected trouble, from the writer's read of the manifests to its manifest written; their
  median), plus, call by call of such a commit, the **injected delay** that calls of the same
  kind were measured to meet at that time;
- an agent's commit (the node's workers gone) first opens the store: its read of the lineage
  counts too when the evicted node was measured making it in its deadline (a worker read it at
  its start);
- the deadline is cut by the windows in which the store failed every call (the bench's
  ``store-fail`` actions, where the measured calls failed), each lasting until the last call
  that failed in it came back (a slowed call fails late: seed 139), then the retry's longest
  pause (1 s, ``retrying`` in training/checkpoints/deadline.py);
- the excuse holds when no stretch left between them is as long as a commit, some injected
  trouble was measured in the deadline, and a healthy commit alone fits in it.

Time no fault injected never counts: a regression that made commits slower under a healthy
store makes the healthy commits slower, and a healthy commit longer than the deadline, or slow
calls with no fault open, excuse nothing.
"""

from __future__ import annotations

import statistics
from typing import Any

RETRY_PAUSE_S = 1.0
"""The longest pause of ``retrying`` between two tries (training/checkpoints/deadline.py)."""
INJECTED_OUTCOMES = ("failed", "timed out")


def calls(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The call lines of a store log, in start order."""
    return sorted((e for e in entries if e.get("what") == "call"), key=lambda e: e["ts"])


def _troubled(call: dict[str, Any]) -> bool:
    return bool(call.get("delay_s")) or bool(call.get("fail"))


def _is_manifest_list(call: dict[str, Any]) -> bool:
    return call["op"] == "list" and "manifest" in call["name"]


def healthy_commits(by_node: dict[str, list[dict[str, Any]]]) -> list[list[dict[str, Any]]]:
    """The calls of every commit that met no injected trouble: one writer's (pid) calls from
    its last list of the manifests before the checkpoint's upload to its manifest written."""
    found = []
    for entries in by_node.values():
        by_pid: dict[int, list[dict[str, Any]]] = {}
        for call in calls(entries):
            by_pid.setdefault(call.get("pid", 0), []).append(call)
        for seq in by_pid.values():
            for i, call in enumerate(seq):
                if call["op"] != "put_new" or call["outcome"] != "ok":
                    continue
                uploads = [j for j in range(i) if seq[j]["op"] == "put"]
                if not uploads:
                    continue
                lists = [j for j in range(uploads[-1]) if _is_manifest_list(seq[j])]
                commit = seq[lists[-1] if lists else uploads[-1] : i + 1]
                if not any(_troubled(c) for c in commit):
                    found.append(commit)
    return found


def _took(commit: list[dict[str, Any]]) -> float:
    return commit[-1]["ts"] + commit[-1]["duration_s"] - commit[0]["ts"]


def _delay(every: list[dict[str, Any]], op: str, begin: float, end: float) -> float:
    """The longest an ``op`` call that met injected trouble took, of those that started in
    [begin, end] (0 when none did: no evidence of a slow store)."""
    return max(
        (
            float(c["duration_s"])
            for c in every
            if c["op"] == op and _troubled(c) and begin <= c["ts"] <= end
        ),
        default=0.0,
    )


def _fail_spans(
    actions: list[dict[str, Any]], every: list[dict[str, Any]], start: float, end: float
) -> list[tuple]:
    """When the store failed every call, as the bench opened it and until the last call that
    failed in it came back, then the retry's pause, within [start, end]."""
    spans = []
    for a in actions:
        if a["kind"] != "store-fail":
            continue
        begin, until = a["ts"], a["ts"] + float(a["seconds"])
        failed = (
            c["ts"] + float(c["duration_s"])
            for c in every
            if c.get("fail") and c["outcome"] != "ok" and begin <= c["ts"] <= until
        )
        spans.append((begin, max([until, *failed]) + RETRY_PAUSE_S))
    return [(max(a, start), min(b, end)) for a, b in sorted(spans) if b > start and a < end]


def _opens_store(calls_of_node: list[dict[str, Any]], start: float, end: float) -> bool:
    """Whether the node read the lineage in [start, end]: its commit is the agent's, which
    opens the store first (``commit_node_save`` in training/loop/saves/emergency.py)."""
    return any(
        c["op"] == "get" and "lineage" in c["name"] and start <= c["ts"] <= end
        for c in calls_of_node
    )


def store_refused(
    start: float,
    end: float,
    actions: list[dict[str, Any]],
    by_node: dict[str, list[dict[str, Any]]],
    node: str | None = None,
) -> tuple[bool, str]:
    """Whether the measured store left no room for ``node``'s commit in [start, end]; and why
    (text)."""
    every = [c for entries in by_node.values() for c in calls(entries)]
    commits = healthy_commits(by_node)
    if not commits:
        return False, "no healthy commit measured in this schedule"
    healthy = statistics.median(_took(c) for c in commits)
    ops = [c["op"] for c in min(commits, key=_took)]
    if node is not None and _opens_store(calls(by_node.get(node, [])), start, end):
        ops.insert(0, "get")
    if healthy >= end - start:
        return False, f"a healthy commit took {healthy:.2f} s, the deadline {end - start:g} s"
    window = [c for c in every if start <= c["ts"] <= end]
    injected = [c for c in window if _troubled(c) or c["outcome"] in INJECTED_OUTCOMES]
    fails = _fail_spans(actions, every, start, end)
    if not injected and not fails:
        return False, "no injected trouble measured in the deadline"
    stretches, cursor = [], start
    for begin, finish in fails:
        if begin > cursor:
            stretches.append((cursor, begin))
        cursor = max(cursor, finish)
    stretches.append((cursor, end))
    for begin, finish in stretches:
        need = healthy + sum(_delay(every, op, begin, finish) for op in ops)
        if finish - begin >= need:
            return False, f"{finish - begin:.2f} s from {begin:.1f} left room for {need:.2f} s"
    return True, f"no stretch of the deadline fitted a commit (healthy {healthy:.2f} s)"
