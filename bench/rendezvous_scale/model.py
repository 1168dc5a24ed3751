"""The rendezvous beyond the node counts this machine can run: a model calibrated on real runs.

Pure: measured medians in, fitted lines and predictions out, no I/O. What it assumes is said
by ``assumptions`` and written next to its numbers, so a modelled row never passes for a
measured one.

What the handler asks of etcd (training/elastic/membership.py, on etcd's v3 API): between
rounds, per agent, one lease keep-alive per heartbeat interval and one new watch stream per
``WATCH_IDLE_INTERVALS`` quiet intervals; in a re-form, per survivor, one transaction on the
state's mod revision (opening the next round: all race, one wins, the losers' transactions
read the state in their failure branch), one lease grant and one transaction for its join, and
for the completer a transaction and a delete of the last round's joins. Every change but a join
reaches every agent's watch as an event with the key's value; the joins reach only the node
that may complete the round (training/elastic/key_copy.py, ``Joins``), so etcd sends a few
changes to N watchers and N joins to one per re-form, and nobody reads the keys again.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from training.elastic.launch import MEASURED_HEARTBEATS_PER_S, RendezvousSettings

WATCH_IDLE_INTERVALS = 5
"""A watch stream that saw no event for this many heartbeat intervals ends, and the next one
starts from the last revision seen (training/elastic/membership.py, ``_watch``): one new watch,
no read."""
REQUESTS_PER_SURVIVOR = 3
"""A survivor's requests in a re-form, by design: the transaction that opens the next round,
a lease grant and the join's transaction."""
REQUESTS_PER_COMPLETION = 4
"""The completer's: the range read of the joins and the watch that follows them, the
transaction that completes the round and the delete of the last round's joins."""
ETCD_CORES = 1.0
"""The cores the modelled etcd gives a re-form: a re-form takes at least etcd's CPU seconds
for it over these (the linear time alone would assume etcd keeps up at any N)."""


@dataclass(frozen=True)
class Line:
    """``y = a + b * n``."""

    a: float
    b: float

    def at(self, n: float) -> float:
        return self.a + self.b * n


@dataclass(frozen=True)
class Quadratic:
    """``y = b * n + c * n**2``: no cost without nodes."""

    b: float
    c: float

    def at(self, n: float) -> float:
        return self.b * n + self.c * n * n


@dataclass(frozen=True)
class Point:
    """One node count's measured medians."""

    nodes: int
    first_round_s: float
    reform_death_s: float
    reform_leave_s: float
    quiet_req_s: float
    reform_requests: float
    """etcd requests during one re-form after a death, from the kill to the last return."""
    reform_etcd_cpu_s: float
    """etcd's CPU seconds over the same window, less what it spends between rounds
    (``quiet_etcd_cores`` over the window): the keep-alives go on during a re-form whether
    or not it happens, and counting them in made a re-form that takes longer at larger N
    cost more again."""
    quiet_etcd_cores: float = 0.0
    """etcd's cores between rounds (keep-alives, watch streams)."""


@dataclass(frozen=True)
class Calibration:
    nodes: tuple[int, ...]
    keep_alive_interval_s: float
    first_round_s: Line
    reform_death_s: Line
    reform_leave_s: Line
    quiet_req_s: Line
    reform_requests: Quadratic
    reform_etcd_cpu_s: Quadratic
    quiet_etcd_cores: Line = Line(0.0, 0.0)


def fit_line(points: Sequence[tuple[float, float]]) -> Line:
    """Least squares ``y = a + b x``; a negative slope (noise) is taken as 0, the mean.

    Needs two distinct x at least: one node count says nothing about growth.
    """
    xs = [float(x) for x, _ in points]
    ys = [float(y) for _, y in points]
    if len(set(xs)) < 2:
        raise ValueError("a line needs measurements at two node counts or more")
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    b = sxy / sxx
    if b < 0:
        return Line(my, 0.0)
    return Line(my - b * mx, b)


def fit_quadratic(points: Sequence[tuple[float, float]]) -> Quadratic:
    """Least squares ``y = b x + c x**2``; when ``c`` comes out negative, ``y = b x``."""
    xs = [float(x) for x, _ in points]
    ys = [float(y) for _, y in points]
    if len(set(xs)) < 2:
        raise ValueError("a quadratic needs measurements at two node counts or more")
    # Normal equations of the two-column design [x, x^2].
    s2 = sum(x**2 for x in xs)
    s3 = sum(x**3 for x in xs)
    s4 = sum(x**4 for x in xs)
    t1 = sum(x * y for x, y in zip(xs, ys, strict=True))
    t2 = sum(x * x * y for x, y in zip(xs, ys, strict=True))
    det = s2 * s4 - s3 * s3
    b = (t1 * s4 - t2 * s3) / det
    c = (s2 * t2 - s3 * t1) / det
    if c < 0:
        return Quadratic(max(t1 / s2, 0.0), 0.0)
    return Quadratic(b, c)


def calibrate(points: Sequence[Point], keep_alive_interval_s: float) -> Calibration:
    """Fit every figure on the measured node counts (one point per count: its medians)."""

    def pairs(attr: str) -> list[tuple[float, float]]:
        return [(p.nodes, getattr(p, attr)) for p in points]

    return Calibration(
        nodes=tuple(sorted(p.nodes for p in points)),
        keep_alive_interval_s=keep_alive_interval_s,
        first_round_s=fit_line(pairs("first_round_s")),
        reform_death_s=fit_line(pairs("reform_death_s")),
        reform_leave_s=fit_line(pairs("reform_leave_s")),
        quiet_req_s=fit_line(pairs("quiet_req_s")),
        reform_requests=fit_quadratic(pairs("reform_requests")),
        reform_etcd_cpu_s=fit_quadratic(pairs("reform_etcd_cpu_s")),
        quiet_etcd_cores=fit_line(pairs("quiet_etcd_cores")),
    )


def expected_quiet_req_s(nodes: int, keep_alive_interval_s: float) -> float:
    """etcd requests/s between rounds from the handler's design: per agent one lease
    keep-alive per interval, and one new watch stream per ``WATCH_IDLE_INTERVALS``."""
    per_agent = 1.0 + 1.0 / WATCH_IDLE_INTERVALS
    return nodes * per_agent / keep_alive_interval_s


def expected_reform_requests(nodes: int, reform_s: float, keep_alive_interval_s: float) -> float:
    """etcd requests of one re-form after a death from the handler's design: each of the
    N - 1 survivors' three, the completer's four, and the keep-alives meanwhile."""
    survivors = nodes - 1
    keep_alives = survivors * reform_s / keep_alive_interval_s
    return REQUESTS_PER_SURVIVOR * survivors + REQUESTS_PER_COMPLETION + keep_alives


def allowed_interval_s(nodes: int, interval_s: float) -> float:
    """The heartbeat interval the stack config lets ``nodes`` agents run
    (stack_config/validate.py: at most ``MEASURED_HEARTBEATS_PER_S`` heartbeats a second)."""
    return max(interval_s, math.ceil(nodes / MEASURED_HEARTBEATS_PER_S))


def freeze_found_s(interval_s: float | None) -> float | None:
    """When a frozen node is taken for dead at the earliest: its key must expire first, after
    the heartbeat times ``keep_alive_max_attempt`` (the lease's TTL; a kill is found at once,
    its probe refused). Every N's re-form is reported beside it: at the heartbeat the stack
    forces a large job, the freeze, not the re-form, is what its survivors wait for."""
    if interval_s is None:
        return None
    return interval_s * RendezvousSettings().keep_alive_max_attempt


def predict(cal: Calibration, nodes: int) -> dict[str, Any]:
    """One modelled row; false deaths are not modelled (None). A re-form takes the fitted
    line's time, or etcd's CPU seconds for it over the cores etcd has left beside its work
    between rounds (``ETCD_CORES`` less the quiet cores) when that is longer; when the
    quiet work alone takes them all, etcd cannot keep up and the re-form has no time (None:
    ``saturated``)."""
    requests = cal.reform_requests.at(nodes)
    cpu_s = cal.reform_etcd_cpu_s.at(nodes)
    # At the interval the stack allows N agents, the work between rounds (a keep-alive per
    # interval, a watch stream per five) shrinks by the ratio of the intervals.
    interval = allowed_interval_s(nodes, cal.keep_alive_interval_s)
    slower = cal.keep_alive_interval_s / interval
    quiet = cal.quiet_etcd_cores.a + cal.quiet_etcd_cores.b * nodes * slower
    free = ETCD_CORES - quiet
    reform_s = max(cal.reform_death_s.at(nodes), cpu_s / free, 1e-3) if free > 0 else None
    return {
        "nodes": nodes,
        "source": "model",
        "first_round_s": round(cal.first_round_s.at(nodes), 3),
        "reform_death_s": None if reform_s is None else round(reform_s, 3),
        "reform_leave_s": round(cal.reform_leave_s.at(nodes), 3),
        "false_deaths": None,
        "keep_alive_interval_s": interval,
        "freeze_found_s": freeze_found_s(interval),
        "quiet_req_s": round(cal.quiet_req_s.a + cal.quiet_req_s.b * nodes * slower, 1),
        "expected_quiet_req_s": round(expected_quiet_req_s(nodes, interval), 1),
        "reform_requests": round(requests),
        "expected_reform_requests": None
        if reform_s is None
        else round(expected_reform_requests(nodes, reform_s, interval)),
        "reform_req_s": None if reform_s is None else round(requests / reform_s, 1),
        "reform_etcd_cpu_s": round(cpu_s, 3),
        "quiet_etcd_cores": round(quiet, 3),
        "saturated": reform_s is None,
        # Cores etcd must have to serve the re-form in the modelled time beside its quiet
        # work; beyond the cores it has, the re-form waits for etcd.
        "reform_etcd_cores": None if reform_s is None else round(cpu_s / reform_s + quiet, 2),
    }


def _line(name: str, line: Line) -> str:
    return f"{name} = {line.a:.3f} + {line.b:.5f} * N"


def assumptions(cal: Calibration) -> list[str]:
    """What the modelled rows rest on, with the fitted coefficients."""
    slope = cal.quiet_req_s.b
    design = expected_quiet_req_s(1, cal.keep_alive_interval_s)
    nodes = ", ".join(str(n) for n in cal.nodes)
    per_join = REQUESTS_PER_SURVIVOR
    return [
        f"Calibrated by least squares on the medians measured at N = {nodes}; "
        "a fitted slope below 0 (noise) is taken as 0.",
        f"Times are linear in N: {_line('first round s', cal.first_round_s)}, "
        f"{_line('re-form after a death s', cal.reform_death_s)}, "
        f"{_line('re-form after a leave s', cal.reform_leave_s)}. A re-form after a death "
        f"takes at least etcd's CPU seconds for it on the part of {ETCD_CORES:g} core that "
        "its work between rounds leaves free: where that is longer, it is the modelled time.",
        "Each modelled N beats at the interval the stack config allows it "
        f"(stack_config/validate.py: at most {MEASURED_HEARTBEATS_PER_S} heartbeats a "
        "second, so N / that many seconds, and never faster than measured); the work between "
        "rounds (keep-alives, watch streams) shrinks by the ratio of the intervals.",
        f"etcd requests/s between rounds are linear in N: {_line('req/s', cal.quiet_req_s)} "
        f"(fitted {slope:.2f} per agent; the design gives {design:.2f}: one lease keep-alive "
        f"per {cal.keep_alive_interval_s:g} s interval, and one new watch stream per "
        f"{WATCH_IDLE_INTERVALS} quiet intervals; no read).",
        f"etcd requests per re-form = {cal.reform_requests.b:.2f} * N + "
        f"{cal.reform_requests.c:.5f} * N^2 (least squares; expected: the design's "
        f"{per_join} per survivor, a transaction that opens the round, a lease grant and the "
        f"join's transaction, {REQUESTS_PER_COMPLETION} for the completer, and the "
        "keep-alives while it lasts). Re-form req/s = requests / modelled re-form time.",
        f"etcd CPU per re-form = {cal.reform_etcd_cpu_s.b:.5f} * N + "
        f"{cal.reform_etcd_cpu_s.c:.7f} * N^2 s: the N term for the transactions and "
        "grants, which etcd orders through its log; the N^2 term for the watch's fan-out, "
        "a change sent as an event to every agent's watch through the JSON gateway (every "
        "change but the joins, which only the completer follows). "
        "It is etcd's CPU over the re-form's window less its cores between rounds over that "
        f"window ({_line('quiet cores', cal.quiet_etcd_cores)}), which the keep-alives "
        "spend whether or not a round re-forms. etcd cores re-form = that CPU / modelled "
        "re-form time + the quiet cores.",
        "False deaths are not modelled (n/a): they are measured only up to the largest real N. "
        "The model assumes a lease keep-alive still completes within the lease's TTL and a "
        "probe is answered within the probe timeout at that N.",
        "One etcd member on loopback, no network latency: a real cluster adds a round trip "
        "per request, and a write waits for a quorum of three members. On the calibrating "
        "machine all N agents share its few cores with etcd, so part of the measured growth "
        "with N is the agents' own CPU (each decodes every event of its watch, and the "
        "completer probes the joiners, up to 32 side by side), which a cluster with one agent "
        "per node does "
        "not share.",
    ]
