"""Faults inferred from a cluster run's logs alone, when no command recorded what it did: each
round after the first is a fault, which began at the first sign of it (a worker's reaction, a
pod being killed, a new pod's start, the autoscaler asking for its node)."""

from __future__ import annotations

from typing import Any, Protocol

from training.records import EMERGENCY_SAVE, METRICS, PEER_FAILURE, RESUMED, Record


class Event(Protocol):
    """What inference reads of a Kubernetes event (``run_logs.ClusterEvent``)."""

    ts: float
    reason: str


_REACTIONS = (PEER_FAILURE, EMERGENCY_SAVE)
# Kubernetes reasons that are the first sign of a pod leaving or arriving.
LEAVING = ("Killing", "Preempting", "Evicted", "PreemptScheduled", "SpotInterruption")
ARRIVING = ("TriggeredScaleUp", "Scheduled", "RegisteredNode")


def infer_faults(records: list[Record], events: list[Event]) -> list[dict[str, Any]]:
    """One injection per membership change: each ``resumed`` round after the first that
    follows training. A leave is dated by its first sign after the last metrics line before
    the round (a worker's reaction, a pod being killed); a join by the arrival of the pod it
    brought (its first record, the scale-up, the scheduling, the new node), which happens
    while the old group still trains."""
    rounds = [r for r in records if r.get("event") == RESUMED]
    metrics = [r for r in records if r["kind"] == METRICS]
    first_seen: dict[str, float] = {}
    for record in records:
        first_seen.setdefault(record["node"], record["ts"])
    faults: list[dict[str, Any]] = []
    since = rounds[0]["ts"] if rounds else 0.0
    for round_ in rounds[1:]:
        before = [m for m in metrics if m["ts"] < round_["ts"]]
        if not before or (faults and faults[-1]["injected_at"] > before[-1]["ts"]):
            continue  # no training since the start or since the previous fault's round
        last = before[-1]
        world, new_world = last["world_size"], int(round_.get("world_size") or 0)
        kind = "leave" if new_world < world else "join" if new_world > world else "restart"
        signs: list[float] = []
        if kind != "join":
            after_last = (last["ts"], round_["ts"])
            signs += [r["ts"] for r in records if _within(r["ts"], after_last) and _reaction(r)]
            signs += [e.ts for e in events if _within(e.ts, after_last) and e.reason in LEAVING]
        if kind != "leave":
            window = (since, round_["ts"])
            signs += [t for t in first_seen.values() if _within(t, window)]
            signs += [e.ts for e in events if _within(e.ts, window) and e.reason in ARRIVING]
        faults.append(
            {
                "index": len(faults),
                "kind": kind,
                "description": f"{kind}: world {world} -> {new_world} (from the logs)",
                "injected_at": min(signs, default=round_["ts"]),
                "planned_world_size": _settled_world(metrics, round_),
            }
        )
        since = round_["ts"]
    return faults


def _within(ts: float, window: tuple[float, float]) -> bool:
    return window[0] < ts <= window[1]


def _reaction(record: Record) -> bool:
    return record.get("event") in _REACTIONS


def _settled_world(metrics: list[Record], round_: Record) -> int:
    """The world size training ran at after this fault's rounds settled."""
    after = [m for m in metrics if m["ts"] > round_["ts"]]
    return int(after[0]["world_size"]) if after else int(round_.get("world_size") or 0)
