"""How long a run trained at each world size, and what the missing workers cost it.

From the metrics lines alone (each says its step's world size and when it ended): the time
between two lines belongs to the world size of the later one, the step that ended there; a gap
longer than the run's pause threshold (``outcomes.pause_after_s``) is time without a step. The
run's full size is the largest world size it trained at.

What missing workers cost: the global batch is the same at every size, so a smaller world
makes each step slower. A second at world ``w`` trains ``rate_w / rate_full`` of a second at
full size; the rest is lost. The rates are the medians of the logged samples/s at each size
(``w / full`` where a size logged none). Time without a step is counted apart (``no_step_s``):
that is the re-forming, not the missing workers.
"""

from __future__ import annotations

import statistics
from typing import Any

from training.records import METRICS, Record


def world_size_time(
    records: list[Record], start_ts: float, end_ts: float, pause_after: float
) -> dict[str, Any] | None:
    """Seconds at each world size, without a step, and lost to missing workers (see the
    module docstring); None when fewer than two metrics lines fall in the span."""
    lines = sorted(
        (r for r in records if r["kind"] == METRICS and start_ts <= r["ts"] <= end_ts),
        key=lambda r: r["ts"],
    )
    if len(lines) < 2:
        return None
    seconds: dict[int, float] = {}
    no_step = 0.0
    for before, line in zip(lines, lines[1:], strict=False):
        gap = line["ts"] - before["ts"]
        if gap > pause_after:
            no_step += gap
        else:
            world = int(line["world_size"])
            seconds[world] = seconds.get(world, 0.0) + gap
    full = max(int(line["world_size"]) for line in lines)
    rates = _median_rates(lines)
    lost = 0.0
    for world, spent in seconds.items():
        share = _share_of_full(world, full, rates)
        lost += spent * (1.0 - share)
    training = sum(seconds.values())
    missing = sum(spent * (full - world) for world, spent in seconds.items())
    return {
        "full_world_size": full,
        "seconds": {str(world): round(spent, 3) for world, spent in sorted(seconds.items())},
        "no_step_s": round(no_step, 3),
        "lost_to_missing_s": round(lost, 3),
        "lost_share": round(lost / training, 4) if training else None,
        "mean_missing": round(missing / training, 4) if training else None,
    }


def _median_rates(lines: list[Record]) -> dict[int, float]:
    by_world: dict[int, list[float]] = {}
    for line in lines:
        rate = line.get("samples_per_s")
        if isinstance(rate, int | float) and rate > 0:
            by_world.setdefault(int(line["world_size"]), []).append(float(rate))
    return {world: statistics.median(rates) for world, rates in by_world.items()}


def _share_of_full(world: int, full: int, rates: dict[int, float]) -> float:
    """What a second at ``world`` trains, as a share of a second at full size (at most 1)."""
    if world in rates and full in rates:
        return min(rates[world] / rates[full], 1.0)
    return world / full
