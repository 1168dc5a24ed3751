"""The on-demand fallback's keys: parsed into the one config object, and every bad value refused
with its key and what is allowed, the first round's join timeout included."""

from __future__ import annotations

import pytest

from stack_config.fallback import MIN_AFTER_MINUTES, VM_START_S
from tests.support.stack_configs import _cfg, _problems


def test_off_by_default_and_on_with_a_ceiling() -> None:
    off = _cfg({})
    assert (off.fallback.enabled, off.fallback.max_nodes, off.fallback.after_minutes) == (
        False,
        0,
        10,
    )
    on = _cfg({"onDemandMaxNodes": "2", "fallbackAfterMinutes": "7", "rdzvJoinTimeout": "1020"})
    assert (on.fallback.enabled, on.fallback.max_nodes, on.fallback.after_minutes) == (True, 2, 7)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"onDemandMaxNodes": "two"}, "spot-lab:onDemandMaxNodes must be an integer, got 'two'"),
        (
            {"onDemandMaxNodes": "-1"},
            "spot-lab:onDemandMaxNodes must be 0 (no on-demand fallback) or a count of on-demand "
            "GPU nodes >= 1, got -1",
        ),
        (
            {"onDemandMaxNodes": "4", "rdzvJoinTimeout": "1200"},
            "spot-lab:onDemandMaxNodes (4) must be 0..spot-lab:workerMaxReplicas (3)",
        ),
        (
            {"fallbackAfterMinutes": "2"},
            f"spot-lab:fallbackAfterMinutes must be a whole number of minutes >= "
            f"{MIN_AFTER_MINUTES}",
        ),
        ({"fallbackAfterMinutes": "1.5"}, "spot-lab:fallbackAfterMinutes must be an integer"),
    ],
)
def test_bad_values_name_the_key_and_what_is_allowed(raw: dict[str, str], message: str) -> None:
    assert message in _problems(raw)


@pytest.mark.parametrize(
    ("raw", "join_s"),
    [
        ({}, 900),
        ({"rdzvJoinTimeout": ""}, 900),
        ({"onDemandMaxNodes": "2"}, 1200),
        ({"onDemandMaxNodes": "2", "rdzvJoinTimeout": ""}, 1200),
        ({"onDemandMaxNodes": "2", "fallbackAfterMinutes": "15"}, 1500),
        # The Spot wait plus a VM start is shorter than the default: the default stays.
        ({"onDemandMaxNodes": "2", "fallbackAfterMinutes": "5"}, 900),
    ],
)
def test_the_fallback_is_on_from_one_key(raw: dict[str, str], join_s: int) -> None:
    """An unset join timeout follows the fallback: the first round outlasts the Spot wait and
    an on-demand VM's start, so `onDemandMaxNodes: 2` alone is a valid stack."""
    assert _cfg(raw).job.rendezvous.join_timeout_s == join_s


def test_the_first_round_must_outlast_the_spot_wait_and_a_vm_start() -> None:
    """A join timeout set to 900 s is shorter than 10 min for Spot + 600 s for an on-demand
    VM: the job would fail "too few nodes joined" before its fallback node joined."""
    message = _problems({"onDemandMaxNodes": "2", "rdzvJoinTimeout": "900"})
    assert (
        "spot-lab:rdzvJoinTimeout (900 s) is shorter than the on-demand fallback needs: "
        "spot-lab:fallbackAfterMinutes (10 min = 600 s) for the Spot pool, then 600 s for an "
        "on-demand VM to start and its worker to join, 1200 s in all; set "
        "spot-lab:rdzvJoinTimeout to 1200 or more, or lower spot-lab:fallbackAfterMinutes"
    ) in message
    assert VM_START_S == 600
    _cfg({"onDemandMaxNodes": "2", "rdzvJoinTimeout": "1200"})  # exactly enough
    _cfg({"onDemandMaxNodes": "2", "fallbackAfterMinutes": "5", "rdzvJoinTimeout": "900"})


def test_the_join_timeout_rule_applies_only_with_the_fallback_on() -> None:
    assert _cfg({"rdzvJoinTimeout": "60"}).fallback.enabled is False


def test_fallback_problems_come_with_the_others() -> None:
    message = _problems({"onDemandMaxNodes": "-1", "fallbackAfterMinutes": "0", "maxSteps": "0"})
    assert "onDemandMaxNodes" in message and "fallbackAfterMinutes" in message
    assert "maxSteps" in message
