"""What a cluster run's GPU nodes cost, Spot and on-demand, and what each move back to Spot saved.

GPU node-hours are approximated by the worker pods' lifetimes in the logs (a node's boot before
its pod started and its drain after are not in them), split by the node each pod ran on: a node
of the on-demand fallback pool (``ond`` + hash, ``catalog/gpu_pools.py``) is on demand;
every other is Spot, since the lab's GPU pool is Spot and a pod whose node the logs do not name
ran there unless the fallback is on. A move of ``lab rebalance`` saved the difference of the
two prices for every hour its worker then ran on its Spot node.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from catalog.gpu_pools import ON_DEMAND, node_kind
from lab.report.run_logs import RunLogs

Prices = Callable[[], tuple[float | None, float | None, str]]
"""(Spot, on-demand) USD per GPU node-hour, and where they came from: what a run is costed at."""


def pod_spans(run: RunLogs) -> dict[tuple[str, str | None], list[float]]:
    """(pod, node) -> [first, last] record time: a pod recreated on another node counts apart."""
    spans: dict[tuple[str, str | None], list[float]] = {}
    for record in run.records:
        pod = record["node"]
        key = (pod, run.node_at(pod, record["ts"]))
        spans.setdefault(key, [record["ts"], record["ts"]])[1] = record["ts"]
    return spans


def _on_demand(node: str | None) -> bool:
    return node is not None and node_kind(node) == ON_DEMAND


def _usd(hours: float, price: float | None) -> float | None:
    if not hours:
        return 0.0
    return None if price is None else round(hours * price, 4)


def cost_of_run(
    run: RunLogs, spot_per_h: float | None, on_demand_per_h: float | None, source: str
) -> dict[str, Any]:
    """GPU node-hours and their cost at Spot and on demand; what the same hours would cost all
    on demand; and each move's saving."""
    spans = pod_spans(run)
    hours = {kind: 0.0 for kind in ("spot", "on_demand")}
    for (_, node), (begin, end) in spans.items():
        hours["on_demand" if _on_demand(node) else "spot"] += (end - begin) / 3600
    total = hours["spot"] + hours["on_demand"]
    spot_usd, on_demand_usd = (
        _usd(hours["spot"], spot_per_h),
        _usd(hours["on_demand"], on_demand_per_h),
    )
    return {
        "gpu_node_hours": round(total, 4),
        "spot_node_hours": round(hours["spot"], 4),
        "on_demand_node_hours": round(hours["on_demand"], 4),
        "spot_usd_per_h": spot_per_h,
        "on_demand_usd_per_h": on_demand_per_h,
        "spot_usd": spot_usd,
        "on_demand_usd": on_demand_usd,
        "total_usd": None if None in (spot_usd, on_demand_usd) else spot_usd + on_demand_usd,
        "all_on_demand_usd": _usd(total, on_demand_per_h),
        "moves": move_savings(run, spans, spot_per_h, on_demand_per_h),
        "price_source": source,
    }


def move_savings(
    run: RunLogs,
    spans: dict[tuple[str, str | None], list[float]],
    spot_per_h: float | None,
    on_demand_per_h: float | None,
) -> list[dict[str, Any]]:
    """Per worker ``lab rebalance`` moved to Spot: its new node, the hours it then ran there, and
    what those hours saved against the on-demand node it left."""
    per_hour = None
    if spot_per_h is not None and on_demand_per_h is not None:
        per_hour = round(on_demand_per_h - spot_per_h, 4)
    moves = []
    for moved in (r for r in run.lab_events if r.get("event") == "worker_moved"):
        pod, node = moved.get("pod"), moved.get("node")
        begin, end = spans.get((pod, node), [moved["ts"], moved["ts"]])
        hours = max(end - max(begin, moved["ts"]), 0.0) / 3600
        moves.append(
            {
                "index": moved.get("index"),
                "pod": pod,
                "from_node": moved.get("from_node"),
                "to_node": node,
                "spot_hours": round(hours, 4),
                "saves_usd_per_h": per_hour,
                "saved_usd": None if per_hour is None else round(hours * per_hour, 4),
            }
        )
    return moves
