"""etcd's own counters, read from its ``/metrics``: what the rendezvous asked of it."""

from __future__ import annotations

import re
import time
import urllib.request

WATCH = 'grpc_method="Watch"'
COUNTERS: dict[str, tuple[tuple[str, str | None, bool], ...]] = {
    "received": (("grpc_server_started_total", WATCH, False),),
    "watches": (("grpc_server_started_total", WATCH, True),),
    "reads": (("etcd_mvcc_range_total", None, True),),
    "writes": (("etcd_mvcc_put_total", None, True), ("etcd_mvcc_delete_total", None, True)),
    "expires": (("etcd_debugging_lease_revoked_total", None, True),),
    "etcd_cpu_s": (("process_cpu_seconds_total", None, True),),
}
"""Each key's families, each with a label it must (True) or must not (False) carry. The
rendezvous speaks etcd's v3 API through the JSON gateway, which calls etcd's own gRPC server:
every request is one gRPC call started (``grpc_server_started_total``; a watch is one stream,
``grpc_method="Watch"``, counted apart, and each lease keep-alive is one stream too). Then the
key-value store's range reads, its puts and deletes (each put or delete of a transaction
counts), the leases revoked (expired, or revoked by a node that left), and etcd's CPU time."""
_SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)(\{[^}]*\})?\s+(\S+)")


def parse_metrics(text: str) -> dict[str, float]:
    """Each counter of COUNTERS summed over its families and labels, from Prometheus' text
    format."""
    totals = dict.fromkeys(COUNTERS, 0.0)
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if not match:
            continue
        name, labels = match.group(1), match.group(2) or ""
        for key, families in COUNTERS.items():
            for family, label, wanted in families:
                if name == family and (label is None or (label in labels) == wanted):
                    totals[key] += float(match.group(3))
    return totals


def scrape(client_url: str) -> dict[str, float]:
    """etcd's counters now, with the monotonic time they were read at (``at``)."""
    with urllib.request.urlopen(f"{client_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {**parse_metrics(text), "at": time.monotonic()}


def etcd_rates(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What etcd did between two scrapes: counts, requests/s (calls and watches), and the CPU
    etcd used, in cores."""
    seconds = max(after["at"] - before["at"], 1e-6)
    diff = {key: after[key] - before[key] for key in COUNTERS}
    requests = diff["received"] + diff["watches"]
    return {
        "seconds": round(seconds, 3),
        **{key: round(value, 3) for key, value in diff.items()},
        "requests": requests,
        "req_s": round(requests / seconds, 1),
        "etcd_cpu_share": round(diff["etcd_cpu_s"] / seconds, 3),
    }
