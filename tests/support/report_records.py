"""The training's records as a lab run's nodes log them, built for the report's tests: metrics
lines, events, the lab's fault injections, and the story of a node killed and replaced."""

from __future__ import annotations

from training.records import EMERGENCY_SAVE, EVENT, METRICS, PEER_FAILURE, RESUMED, STARTED

START = 1000.0


def metrics(ts: float, step: int, world: int, loss: float = 1.0, node: str = "node-0") -> dict:
    return {
        "ts": START + ts,
        "kind": METRICS,
        "rank": 0,
        "node": node,
        "step": step,
        "world_size": world,
        "loss": loss,
        "samples_per_s": 100.0,
        "epoch": 0,
    }


def event(ts: float, name: str, node: str = "node-0", **fields) -> dict:
    return {"ts": START + ts, "kind": EVENT, "event": name, "rank": 0, "node": node, **fields}


def injection(index: int, ts: float, kind: str, planned: int) -> dict:
    return {
        "index": index,
        "kind": kind,
        "description": f"{kind} #{index}",
        "injected_at": START + ts,
        "planned_world_size": planned,
    }


def _kill_story() -> list[dict]:
    """3 nodes train to step 12; node-0 dies at t=12.5; survivors resume at 12 on 2 nodes."""
    records = [event(0.5, STARTED), event(1.0, RESUMED, step=0, source="fresh", world_size=3)]
    records += [metrics(1.0 + i, i, 3) for i in range(1, 13)]
    records += [
        event(12.6, PEER_FAILURE, node="node-1", step=12),
        event(12.7, EMERGENCY_SAVE, node="node-1", step=12, reason="peer_failure"),
        event(17.0, STARTED, node="node-1"),
        event(18.0, RESUMED, node="node-1", step=12, source="local", lost_steps=0, world_size=2),
    ]
    records += [metrics(18.5 + i, 12 + i, 2, node="node-1") for i in range(1, 9)]
    return sorted(records, key=lambda r: r["ts"])
