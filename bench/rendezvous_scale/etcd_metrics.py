"""etcd's own counters, read from its ``/metrics``: what the rendezvous asked of it."""

from __future__ import annotations

import re
import time
import urllib.request

COUNTERS = {
    "received": "etcd_http_received_total",
    "reads": "etcd_debugging_store_reads_total",
    "writes": "etcd_debugging_store_writes_total",
    "watches": "etcd_debugging_store_watch_requests_total",
    "expires": "etcd_debugging_store_expires_total",
    "etcd_cpu_s": "process_cpu_seconds_total",
}
"""etcd 3.5's counters: the v2 requests received, which leave watches out (its keys
handler counts a request only ``if !rr.Wait``), and the v2 store's reads, writes, watches
(one per watch request) and TTL expiries; plus etcd's own CPU time."""
_SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)(\{[^}]*\})?\s+(\S+)")


def parse_metrics(text: str) -> dict[str, float]:
    """Each counter of COUNTERS summed over its labels, from Prometheus' text format."""
    families = {family: key for key, family in COUNTERS.items()}
    totals = dict.fromkeys(COUNTERS, 0.0)
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and match.group(1) in families:
            totals[families[match.group(1)]] += float(match.group(3))
    return totals


def scrape(client_url: str) -> dict[str, float]:
    """etcd's counters now, with the monotonic time they were read at (``at``)."""
    with urllib.request.urlopen(f"{client_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {**parse_metrics(text), "at": time.monotonic()}


def etcd_rates(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What etcd did between two scrapes: counts, requests/s (reads, writes and watches),
    and the CPU etcd used, in cores."""
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
