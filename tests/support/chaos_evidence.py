"""What a chaos schedule leaves, built for the invariants' tests: the nodes' records, the lab's
actions, the store's calls, a node's own lines, and an evidence of a run that kept every step."""

from __future__ import annotations

import re
from typing import Any

from bench.chaos.invariants import Evidence
from training.records import EVENT, FINISHED, METRICS, RESUMED, STARTED

T0 = 1_800_000_000.0


def _metrics(ts: float, step: int, round_: int, node: str = "node-0") -> dict[str, Any]:
    return {"ts": T0 + ts, "kind": METRICS, "step": step, "rdzv_round": round_, "node": node}


def _event(ts: float, name: str, node: str, round_: int, **fields: Any) -> dict[str, Any]:
    return {"ts": T0 + ts, "kind": EVENT, "event": name, "node": node, "rdzv_round": round_}


def _started(
    ts: float, node: str, round_: int, rank: int = 0, world: int = 1, nproc: int = 1
) -> dict[str, Any]:
    """A worker's first line in a round: rank ``rank`` of ``world``, ``nproc`` a node."""
    local, group = rank % nproc, rank // nproc
    ranks = {"rank": rank, "world_size": world, "local_rank": local, "group_rank": group}
    return _event(ts, STARTED, node, round_) | ranks


def _resumed(ts: float, node: str, round_: int, step: int, source: str) -> dict[str, Any]:
    return {**_event(ts, RESUMED, node, round_), "step": step, "source": source}


def _node(ts: float, event: str, node: str, **fields: Any) -> dict[str, Any]:
    return {"ts": T0 + ts, "event": event, "node": node, **fields}


def _action(ts: float, kind: str, *nodes: str, **fields: Any) -> dict[str, Any]:
    return {"ts": T0 + ts, "kind": kind, "nodes": list(nodes), **fields}


def _evidence(**overrides: Any) -> Evidence:
    """Two nodes train rounds 1 (steps 1-5) and, after node-1 is lost, 2 at world 1."""
    records = [
        _started(1, "node-0", 1, 0, 2),
        _started(1, "node-1", 1, 1, 2),
        _resumed(2, "node-0", 1, 0, "fresh"),
        *(_metrics(2 + s, s, 1) for s in range(1, 6)),
        _started(9, "node-0", 2),
        _resumed(10, "node-0", 2, 5, "local"),
        *(_metrics(10 + s, 5 + s, 2) for s in range(1, 6)),
        {**_event(16, FINISHED, "node-0", 2), "step": 10},
    ]
    values: dict[str, Any] = {
        "records": records,
        "lab_events": [
            _node(0, "node_started", "node-0"),
            _node(0, "node_started", "node-1"),
            _node(17, "node_exited", "node-0", code=0),
        ],
        "actions": [_action(1.5, "warm"), _action(7.5, "kill", "node-1")],
        "final_codes": {"node-0": 0, "node-1": -9},
        "agent_logs": {},
        "ack_checks": [],
        "newest_verified": 10,
        "parameter_difference": 0.0,
        "status": "finished",
        "max_steps": 10,
        "stop_deadline_s": 10.0,
    }
    values.update(overrides)
    return Evidence(**values)


def _call(ts: float, op: str, took: float, **fields: Any) -> dict[str, Any]:
    """One store call as the faulty store logs it (no trouble unless ``fields`` say so)."""
    name = {"put": "ckpt-5.pt", "put_new": "ckpt-manifest-2", "list": "ckpt-manifest-"}
    line = {"ts": T0 + ts, "op": op, "name": name.get(op, "ckpt-manifest-1"), "what": "call"}
    line |= {"duration_s": took, "outcome": "ok", "delay_s": 0.0, "fail": False, "pid": 7}
    return line | fields


def _commit(ts: float, took: float = 0.4) -> list[dict[str, Any]]:
    """A periodic commit of node-0: read the log, upload, publish; ``took`` in all."""
    each = took / 4
    return [
        _call(ts + i * each, op, each) for i, op in enumerate(("list", "get", "put", "put_new"))
    ]


def _local(line: str, at: float = 13) -> str:
    """``line`` stamped ``at`` s after T0, in the local time the agent's log uses."""
    import time

    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(T0 + at))
    return re.sub(r"^\S+ \S+,", stamp + ",", line)
