"""A cluster run's pod logs as `kubectl logs --timestamps` prints them, and the cluster's events:
the workers' names, and the story of an eviction and its replacement on a new node."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from training.records import (
    EMERGENCY_SAVE,
    EVENT,
    FINISHED,
    METRICS,
    PEER_FAILURE,
    RESUMED,
    STARTED,
)

T0 = 1_790_000_000.0  # 2026-09-21, a time on the cluster's clock
NS = "spot-lab"
JOB = "spotlab-train"


def stamp(ts: float) -> str:
    """RFC 3339 with nanoseconds, as kubectl and the API server write times."""
    whole = datetime.fromtimestamp(int(ts), UTC).strftime("%Y-%m-%dT%H:%M:%S")
    return f"{whole}.{round(ts % 1 * 1e9):09d}Z"


def _line(ts: float, **record: Any) -> str:
    return f"{stamp(ts)} {json.dumps({'ts': ts, 'rank': 0, **record})}"


def metrics(ts: float, step: int, world: int, loss: float = 1.0) -> str:
    return _line(T0 + ts, kind=METRICS, step=step, world_size=world, loss=loss, samples_per_s=500.0)


def event(ts: float, name: str, **fields: Any) -> str:
    return _line(T0 + ts, kind=EVENT, event=name, **fields)


def k8s_event(ts: float, reason: str, kind: str, name: str, message: str = "") -> dict[str, Any]:
    """A core/v1 Event as `kubectl get events -o json` lists it."""
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{name}.{int(ts)}", "namespace": NS},
        "involvedObject": {"kind": kind, "name": name, "namespace": NS},
        "reason": reason,
        "message": message,
        "type": "Normal",
        "firstTimestamp": stamp(T0 + ts).split(".")[0] + "Z",
        "lastTimestamp": stamp(T0 + ts).split(".")[0] + "Z",
        "count": 1,
    }


W0, W1, W2 = f"{JOB}-worker-0", f"{JOB}-worker-1", f"{JOB}-worker-2"
NEW_NODE = "aks-gpu1a2b3c4d-12345678-vmss000007"


def eviction_logs(origin: float = T0) -> tuple[dict[str, str], list[dict[str, Any]]]:
    """Three workers train; worker-2's Spot node is evicted at t=100 (SIGTERM, an emergency
    save, the pod goes, its node is removed); the two others resume at t=103.5. A new node
    is asked for at t=110, registers at t=290, its pod is scheduled, pulls the image, starts
    at t=400 and joins at t=408: training is back at three from t=409."""
    o = origin - T0  # every time below is T0 + seconds
    logs: dict[str, list[str]] = {W0: [], W1: [], W2: []}
    for pod in (W0, W1, W2):
        logs[pod].append(event(o + 1.0, STARTED, max_steps=400, global_batch_size=256))
    logs[W0].append(event(o + 2.0, RESUMED, step=0, source="fresh", world_size=3))
    logs[W0] += [metrics(o + 2.0 + i, i, 3, loss=2.0 - i / 100) for i in range(1, 98)]  # to t=99
    logs[W2].append(event(o + 100.2, EMERGENCY_SAVE, step=97, reason="sigterm"))
    logs[W0].append(event(o + 100.8, PEER_FAILURE, step=97))
    logs[W0].append(event(o + 103.5, RESUMED, step=97, source="local", world_size=2))
    logs[W0] += [
        metrics(o + 104.0 + i, 97 + i, 2, loss=1.0) for i in range(1, 301) if 104 + i < 404
    ]
    logs[W2 + "x"] = [event(o + 400.0, STARTED, max_steps=400, global_batch_size=256)]
    logs[W0].append(event(o + 408.0, RESUMED, step=396, source="local", world_size=3))
    logs[W0] += [metrics(o + 408.0 + i, 396 + i, 3, loss=0.5) for i in range(1, 5)]
    logs[W0].append(event(o + 413.0, FINISHED, step=400))
    texts = {pod: "\n".join(sorted(lines)) + "\nnot json\n" for pod, lines in logs.items()}
    events = [
        k8s_event(o + 100.0, "Killing", "Pod", W2, "Stopping container pytorch"),
        k8s_event(o + 100.5, "RemovingNode", "Node", "aks-gpu1a2b3c4d-12345678-vmss000002"),
        k8s_event(o + 110.0, "TriggeredScaleUp", "Pod", W2 + "x", "pod triggered scale-up"),
        k8s_event(
            o + 290.0, "RegisteredNode", "Node", NEW_NODE, f"Node {NEW_NODE} event: Registered"
        ),
        k8s_event(
            o + 300.0, "Scheduled", "Pod", W2 + "x", f"Successfully assigned {W2}x to {NEW_NODE}"
        ),
        k8s_event(o + 390.0, "Pulled", "Pod", W2 + "x", "Successfully pulled image in 88s"),
    ]
    return texts, events


def eviction_story(root: Path) -> Path:
    """``eviction_logs`` saved as a user would: pod logs and ``kubectl get events -o json``."""
    texts, events = eviction_logs()
    (root / "pods").mkdir(parents=True)
    for pod, text in texts.items():
        (root / "pods" / f"{pod}.log").write_text(text)
    (root / "events.json").write_text(json.dumps({"kind": "List", "items": events}))
    return root
