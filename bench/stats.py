"""Medians with min and max over repetitions, where a run may not have recovered at all.

A run that did not recover within the cap has no downtime, only a lower bound: the cap. It
enters the statistics as the cap and is counted in ``no_recovery``, so a median that rests
on such runs is flagged as a lower bound (``at_least``) instead of passing for a measurement.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any


def _round(value: float) -> float:
    return round(value, 3)


def summarize(values: Sequence[float | None], cap_s: float | None = None) -> dict[str, Any]:
    """``{median, min, max, n, no_recovery, censored_at_s, at_least}`` of ``values``.

    ``None`` is a run without recovery; it needs ``cap_s``, the wait it was given up after.
    """
    if not values:
        raise ValueError("summarize needs at least one value")
    missing = sum(1 for v in values if v is None)
    if missing and cap_s is None:
        raise ValueError("a run without recovery (None) needs cap_s, the wait it was capped at")
    filled = sorted(float(cap_s if v is None else v) for v in values)  # type: ignore[arg-type]
    n = len(filled)
    return {
        "median": _round(statistics.median(filled)),
        "min": _round(filled[0]),
        "max": _round(filled[-1]),
        "n": n,
        "no_recovery": missing,
        "censored_at_s": cap_s if missing else None,
        # The censored runs sort last; the median is one of them once they are half or more.
        "at_least": missing >= (n + 1) // 2,
    }


def summarize_known(values: Sequence[float | None]) -> dict[str, Any] | None:
    """``summarize`` of the values that were measured, or None when none was."""
    known = [v for v in values if v is not None]
    return summarize(known) if known else None


def median_of(values: Sequence[float | None]) -> float | None:
    """The median of the measured values, or None when none was."""
    known = [float(v) for v in values if v is not None]
    return _round(statistics.median(known)) if known else None


def ratio(numerator: dict[str, Any] | None, denominator: dict[str, Any] | None) -> dict[str, Any]:
    """Median over median, flagged ``at_least`` when the numerator's median is a lower bound.

    None when either side is missing, or the denominator's median is itself only a bound.
    """
    if not numerator or not denominator or denominator["at_least"] or not denominator["median"]:
        return {"value": None, "at_least": False}
    return {
        "value": round(numerator["median"] / denominator["median"], 2),
        "at_least": bool(numerator.get("at_least")),
    }
