"""How many workers a Spot job misses at any moment, and how many to ask for so that at least a
target world size trains with a stated probability. Pure: ``lab prices`` and a run's report
read it.

The model: each worker slot is an alternating renewal process. Its node is up for a time with
mean ``1/rate`` (the region's eviction rate per node-hour; exponential for the simulation,
though only the mean matters below), then down for the replacement time ``R`` (eviction to the
replacement's first step; ``lab drill`` measures it). The long-run fraction of time a slot is
down is then

    p = E[down] / (E[up] + E[down]) = rate·R / (1 + rate·R)

whatever the distributions (renewal-reward). With slots evicted independently of each other,
the number missing at a random moment is Binomial(N, p): expected ``N·p``, and the
probability that at least ``target`` train is ``P(Binomial(N, 1 - p) >= target)``. The
recommendation is the smallest ``N >= target`` for which that probability reaches the one asked
for: the pool's and the job's maximum size.

What it does not cover: a wave (Azure reclaiming capacity in the region takes many Spot VMs
at once) correlates the slots, and the tail of the missing count is then far heavier than the
binomial's; no headroom of the same Spot pool protects against it (the on-demand fallback
does). Nor does it cover a replacement that cannot be had at all (no Spot capacity), which
lengthens ``R`` without bound. Read the probability as the share of time, between waves, that
the job trains at ``target`` or more.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_WORKERS = 1000
"""The largest job the recommendation searches: far beyond a lab's, and still exact."""


class HeadroomError(ValueError):
    """An input out of range; the message names the flag and the allowed range."""


@dataclass(frozen=True)
class Headroom:
    """The model's answer for one region."""

    rate_per_hour: float
    replacement_h: float
    target: int
    probability: float
    unavailability: float
    """p: the share of time one slot has no worker."""
    workers: int
    """N: the pool's and the job's maximum size."""
    expected_missing: float
    """N·p."""
    achieved: float
    """P(at least ``target`` of N train), >= ``probability``."""
    without_headroom: float
    """The same probability with N = target: what no headroom gives."""


def unavailability(rate_per_hour: float, replacement_h: float) -> float:
    """p = λR / (1 + λR): the long-run share of time a slot is down."""
    down = rate_per_hour * replacement_h
    return down / (1.0 + down)


def at_least(workers: int, target: int, p_missing: float) -> float:
    """P(at least ``target`` of ``workers`` slots are up), slots down independently with
    probability ``p_missing``: the binomial's upper tail, summed exactly."""
    if target <= 0:
        return 1.0
    if target > workers:
        return 0.0
    up = 1.0 - p_missing
    if up <= 0.0:
        return 0.0
    if p_missing <= 0.0:
        return 1.0
    # Summed in logs: exact enough for N in the thousands without overflow.
    terms = (
        math.lgamma(workers + 1)
        - math.lgamma(k + 1)
        - math.lgamma(workers - k + 1)
        + k * math.log(up)
        + (workers - k) * math.log(p_missing)
        for k in range(target, workers + 1)
    )
    return min(1.0, math.fsum(math.exp(t) for t in terms))


def check_inputs(
    rate_per_hour: float, replacement_h: float, target: int, probability: float
) -> None:
    """``HeadroomError`` naming the first input out of range (the flags of ``lab prices``)."""
    if not (math.isfinite(rate_per_hour) and 0.0 <= rate_per_hour <= 1.0):
        raise HeadroomError(
            f"--eviction-rate must be a percentage per node-hour from 0 to 100; got "
            f"{rate_per_hour * 100:g}"
        )
    if not (math.isfinite(replacement_h) and 0.0 < replacement_h <= 24.0):
        raise HeadroomError(
            f"--replacement-minutes must be minutes > 0 and at most 1440; got "
            f"{replacement_h * 60:g}"
        )
    if not 1 <= target <= MAX_WORKERS:
        raise HeadroomError(
            f"--target-workers must be a whole number from 1 to {MAX_WORKERS}; got {target}"
        )
    if not (math.isfinite(probability) and 0.0 < probability < 1.0):
        raise HeadroomError(
            f"--probability must be a number between 0 and 1 (exclusive); got {probability:g}"
        )


def recommend(
    rate_per_hour: float, replacement_h: float, target: int, probability: float
) -> Headroom:
    """The smallest N that keeps at least ``target`` workers training with ``probability``.

    ``HeadroomError`` for an input out of range, or when even ``MAX_WORKERS`` would not do
    (a slot down most of the time)."""
    check_inputs(rate_per_hour, replacement_h, target, probability)
    p = unavailability(rate_per_hour, replacement_h)
    workers = target
    while (achieved := at_least(workers, target, p)) < probability:
        workers += 1
        if workers > MAX_WORKERS:
            raise HeadroomError(
                f"no job of up to {MAX_WORKERS} workers keeps {target} training with "
                f"probability {probability:g} when each is missing {p:.0%} of the time: lower "
                "--probability or --replacement-minutes"
            )
    return Headroom(
        rate_per_hour=rate_per_hour,
        replacement_h=replacement_h,
        target=target,
        probability=probability,
        unavailability=p,
        workers=workers,
        expected_missing=workers * p,
        achieved=achieved,
        without_headroom=at_least(target, target, p),
    )


def band_rate(band: str | None) -> float | None:
    """The eviction rate per node-hour a band stands for: its upper bound ("10-15" -> 0.15),
    so the recommendation errs on the safe side; "20+" gives its floor, 0.20, the least it can
    be. None for no band."""
    if not band:
        return None
    bounds = band.replace("+", "").split("-")
    try:
        return float(bounds[-1]) / 100.0
    except ValueError:
        return None


def cost_per_1000_steps(
    price_per_node_h: float | None, step_s_at_target: float, target: int
) -> float | None:
    """USD per 1,000 steps, each step taking ``step_s_at_target`` at the target world size.

    The global batch is the same at every world size, so a step's work is shared: at world
    ``w`` a step takes ``step_s · target / w`` (linear scaling: an upper bound on the speed,
    since the all-reduce does not shrink). The node-hours of a step, and so its cost, are then
    the same at any size: headroom buys speed, not cost. A node being replaced is not billed
    (the evicted VM is gone; the new one bills from its start, a part of ``R``)."""
    if price_per_node_h is None:
        return None
    return 1000.0 * step_s_at_target * target / 3600.0 * price_per_node_h


def hours_per_1000_steps(workers: float, step_s_at_target: float, target: int) -> float:
    """Wall hours per 1,000 steps at an average of ``workers`` training (linear scaling)."""
    return 1000.0 * step_s_at_target * target / max(workers, 1e-9) / 3600.0


def measured_replacement_s(report: dict) -> list[float]:
    """Each replacement's time, eviction to the first step at full size, in a run's report
    (the last row of ``lab drill``'s table); only those that got there."""
    times = []
    for fault in report.get("faults") or []:
        path = fault.get("replacement_steps") or {}
        steps = path.get("steps") or []
        if steps and steps[-1].get("since_eviction_s") is not None:
            times.append(float(steps[-1]["since_eviction_s"]))
    return times


REPLACEMENT_MIN = 11.0
"""Eviction to the replacement's first step, in minutes, when no drill measured it: the upper
end of the 7-11 min docs/azure.md puts together from AKS's and the autoscaler's sources."""


@dataclass(frozen=True)
class HeadroomPlan:
    """What the headroom recommendation is asked for (``lab prices``' flags, checked)."""

    target: int
    probability: float
    replacement_min: float
    replacement_source: str
    rate_pct: float | None = None
    """Eviction rate per node-hour in percent; None takes the stack region's band."""
    step_s: float | None = None
    """Seconds per step at the target world size, to price 1,000 steps; None: not priced."""
