"""The headroom model against a simulation of random evictions, on fixed seeds.

Each worker slot is simulated as the model describes it: up for an exponential time of rate
λ, then down for the replacement time R, again and again, independently of the others. The
share of time at least the target trains must be what the model says, and the recommended N
must reach the probability asked for, where N - 1 does not.
"""

from __future__ import annotations

import random

import pytest

from lab.report.headroom import (
    HeadroomError,
    at_least,
    band_rate,
    cost_per_1000_steps,
    recommend,
    unavailability,
)


def simulate(
    workers: int, target: int, rate_h: float, replacement_h: float, horizon_h: float, seed: int
) -> tuple[float, float]:
    """(share of time at least ``target`` slots are up, mean slots down) over ``horizon_h``."""
    rng = random.Random(seed)
    changes: list[tuple[float, int]] = []  # (when, +1 a slot comes back / -1 it goes down)
    for _ in range(workers):
        t = 0.0
        while True:
            t += rng.expovariate(rate_h)
            if t >= horizon_h:
                break
            changes.append((t, -1))
            t += replacement_h
            if t >= horizon_h:
                break
            changes.append((t, +1))
    changes.sort()
    up, last, enough, down_time = workers, 0.0, 0.0, 0.0
    for when, change in changes:
        enough += (when - last) if up >= target else 0.0
        down_time += (when - last) * (workers - up)
        up, last = up + change, when
    enough += (horizon_h - last) if up >= target else 0.0
    down_time += (horizon_h - last) * (workers - up)
    return enough / horizon_h, down_time / horizon_h


@pytest.mark.parametrize(
    ("rate_h", "replacement_min", "target", "probability", "seed"),
    [
        (0.15, 11.0, 3, 0.95, 1),  # westus3's band 10-15 %, today's replacement
        (0.20, 11.0, 8, 0.99, 2),  # the worst band, a larger job, a stricter target
        (0.05, 5.0, 16, 0.95, 3),  # a calm region with the ≤ 5 min goal
        (0.50, 30.0, 4, 0.9, 4),  # a bad day: each slot down a fifth of the time
    ],
)
def test_the_recommendation_meets_its_probability_in_a_simulation(
    rate_h: float, replacement_min: float, target: int, probability: float, seed: int
) -> None:
    room = recommend(rate_h, replacement_min / 60.0, target, probability)
    horizon = 400_000.0 / (rate_h * room.workers)  # 400,000 evictions in all
    share, mean_down = simulate(room.workers, target, rate_h, replacement_min / 60.0, horizon, seed)
    assert share == pytest.approx(room.achieved, abs=0.002)
    assert share >= probability - 0.002
    assert mean_down == pytest.approx(room.expected_missing, rel=0.01)
    if room.workers > target:  # one worker fewer falls short: N is the smallest that does
        fewer = at_least(room.workers - 1, target, room.unavailability)
        assert fewer < probability
        share_fewer, _ = simulate(
            room.workers - 1, target, rate_h, replacement_min / 60.0, horizon, seed + 100
        )
        assert share_fewer == pytest.approx(fewer, abs=0.002)


def test_the_model_in_numbers() -> None:
    # 15 % a node-hour, 11 min: p = 0.0275 / 1.0275.
    p = unavailability(0.15, 11 / 60)
    assert p == pytest.approx(0.0275 / 1.0275)
    room = recommend(0.15, 11 / 60, 3, 0.95)
    assert room.without_headroom == pytest.approx((1 - p) ** 3)  # 92.2 %: short of 95 %
    assert room.workers == 4
    assert room.achieved == pytest.approx((1 - p) ** 4 + 4 * p * (1 - p) ** 3)
    assert room.expected_missing == pytest.approx(4 * p)
    # No eviction: no headroom.
    assert recommend(0.0, 11 / 60, 5, 0.99).workers == 5


def test_bands_stand_for_their_upper_end_and_cost_per_step_ignores_headroom() -> None:
    assert band_rate("10-15") == 0.15
    assert band_rate("0-5") == 0.05
    assert band_rate("20+") == 0.20
    assert band_rate(None) is None and band_rate("n/a") is None
    # 2 s a step at 3 workers at $0.0915 a node-hour: 6 node-seconds a step.
    assert cost_per_1000_steps(0.0915, 2.0, 3) == pytest.approx(1000 * 6 / 3600 * 0.0915)
    assert cost_per_1000_steps(None, 2.0, 3) is None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((1.5, 0.2, 3, 0.95), "--eviction-rate must be a percentage per node-hour from 0 to 100"),
        ((-0.1, 0.2, 3, 0.95), "--eviction-rate must be a percentage"),
        ((0.1, 0.0, 3, 0.95), "--replacement-minutes must be minutes > 0 and at most 1440"),
        ((0.1, 0.2, 0, 0.95), "--target-workers must be a whole number from 1 to 1000; got 0"),
        ((0.1, 0.2, 1001, 0.95), "--target-workers must be a whole number from 1 to 1000"),
        ((0.1, 0.2, 3, 1.0), "--probability must be a number between 0 and 1 (exclusive)"),
        ((0.1, 0.2, 3, float("nan")), "--probability must be a number between 0 and 1"),
    ],
)
def test_inputs_out_of_range_name_the_flag(
    args: tuple[float, float, int, float], message: str
) -> None:
    with pytest.raises(HeadroomError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        recommend(*args)


def test_a_slot_down_most_of_the_time_is_refused_not_searched_forever() -> None:
    with pytest.raises(HeadroomError, match="no job of up to 1000 workers keeps 900 training"):
        recommend(1.0, 24.0, 900, 0.99)
