"""The workers' permit to step (training/elastic/permit.py): granted by the agent's polls,
checked with etcd after a gap, held by the workers."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from training.elastic.permit import PERMIT_FILE_ENV, Keeper, Pauses, Permit


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_a_new_permit_has_run_out_until_the_agent_grants_it(tmp_path: Path) -> None:
    agent = Permit(tmp_path / "permit", writable=True)
    worker = Permit(tmp_path / "permit")
    assert worker.until() == 0.0
    agent.grant(1234.5)
    assert worker.until() == 1234.5


def test_a_worker_without_an_agents_permit_is_never_held(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(PERMIT_FILE_ENV, raising=False)
    assert Permit.of_worker() is None
    monkeypatch.setenv(PERMIT_FILE_ENV, str(tmp_path / "not-made"))
    assert Permit.of_worker() is None  # an agent whose handler keeps none
    Permit(tmp_path / "made", writable=True)
    monkeypatch.setenv(PERMIT_FILE_ENV, str(tmp_path / "made"))
    assert Permit.of_worker() is not None


def test_polls_on_time_renew_the_permit_without_asking_etcd(tmp_path: Path) -> None:
    clock, asked = Clock(), []
    permit = Permit(tmp_path / "permit", writable=True)
    keeper = Keeper(permit, lambda: asked.append(1) or True, clock, gap_s=0.5)
    keeper.started()
    for _ in range(20):  # the monitor loop's polls, 0.1 s apart
        clock.now += 0.1
        assert keeper.tick()
        assert permit.until() == pytest.approx(clock.now + 0.5)
    assert asked == []  # an etcd outage between rounds changes nothing


@pytest.mark.parametrize(
    ("etcd_says", "renewed", "reform"),
    [(True, True, False), (False, False, True), (None, False, False)],
    ids=["still-its-round", "the-run-left-it", "etcd-silent"],
)
def test_after_a_gap_the_permit_is_renewed_only_once_etcd_confirms_the_round(
    tmp_path: Path, etcd_says: bool | None, renewed: bool, reform: bool
) -> None:
    clock, asked = Clock(), []

    def still_current() -> bool | None:
        asked.append(clock.now)
        return etcd_says

    permit = Permit(tmp_path / "permit", writable=True)
    keeper = Keeper(permit, still_current, clock, gap_s=0.5)
    keeper.started()
    clock.now += 3.0  # the agent was paused with its workers
    assert keeper.tick() is not reform
    assert asked == [clock.now]
    assert (permit.until() > clock.now) is renewed
    if etcd_says is None:  # silent: the next poll asks again, and the workers wait meanwhile
        clock.now += 0.1
        keeper.tick()
        assert len(asked) == 2 and permit.until() < clock.now


def test_a_held_worker_waits_for_the_grant_and_says_so_once(tmp_path: Path) -> None:
    agent = Permit(tmp_path / "permit", writable=True)
    worker = Permit(tmp_path / "permit")
    told: list[float] = []
    waiting = threading.Event()
    result: list[float | None] = []

    def hold() -> None:
        result.append(worker.hold(lambda: False, lambda s: (told.append(s), waiting.set())))

    holder = threading.Thread(target=hold)
    holder.start()
    assert waiting.wait(30)  # it found the permit run out
    assert result == []
    granted = time.time()
    agent.grant(float("inf"))
    holder.join(30)
    # The time of the check that found it holding: after the grant, not when the wait began.
    assert len(result) == 1 and granted <= result[0] <= time.time(), (granted, result)
    assert len(told) == 1


def test_a_stop_ends_the_wait_without_a_permit(tmp_path: Path) -> None:
    Permit(tmp_path / "permit", writable=True)  # never granted
    worker = Permit(tmp_path / "permit")
    told: list[float] = []
    assert worker.hold(lambda: bool(told), told.append) is None
    assert len(told) == 1


def test_a_process_sees_its_own_pause_even_before_its_watch_looks_again() -> None:
    clock = Clock()
    pauses = Pauses(gap_s=0.5, clock=clock, watch=False)
    for _ in range(10):  # running: the watch looks every 0.05 s
        clock.now += 0.05
        pauses.look()
    granted = clock.now
    assert not pauses.since(granted - 1)
    clock.now += 5.0  # SIGSTOP ... SIGCONT: this thread runs before the watch
    assert pauses.since(granted)
    pauses.look()
    clock.now += 0.05
    pauses.look()
    assert pauses.since(granted)  # the pause came after the grant
    assert not pauses.since(clock.now - 0.01)  # a grant after it


def test_a_worker_that_ran_on_is_not_held_by_an_agent_stopped_alone(tmp_path: Path) -> None:
    agent = Permit(tmp_path / "permit", writable=True)
    clock = Clock(now=0.0)
    running = Pauses(gap_s=0.5, clock=clock, watch=False)  # no pause of its own, ever
    agent.grant(-1.0)  # a grant long run out: the agent stopped (a wedged agent)
    told: list[float] = []
    assert Permit(tmp_path / "permit").hold(lambda: False, told.append, running) is not None
    assert told == []


def test_the_permit_never_reaches_past_the_fence_and_then_the_group_reforms(
    tmp_path: Path,
) -> None:
    """The fence: the lease's TTL past the last keep-alive etcd answered, less the margin."""
    permit = Permit(tmp_path / "permit", writable=True)
    clock = Clock()
    fence = [clock.now + 2.0]
    keeper = Keeper(permit, lambda: True, clock, gap_s=0.5, fence=lambda: fence[0])
    keeper.started()
    assert permit.read() == (clock.now + 0.5, False)
    clock.now += 1.7
    assert keeper.tick() and permit.read() == (fence[0], True)  # cut short, and fenced
    clock.now += 0.3
    assert not keeper.tick() and not keeper.tick()  # past it: re-form, and keep saying so
    fence[0] = clock.now + 2.0  # etcd answered a keep-alive again; the next round starts
    keeper.started()
    assert permit.read() == (clock.now + 0.5, False)


def test_a_fenced_permit_holds_a_worker_that_never_paused(tmp_path: Path) -> None:
    """A lapse the fence wrote is no wedged agent's: the worker waits whatever its pauses."""
    agent = Permit(tmp_path / "permit", writable=True)
    running = Pauses(gap_s=0.5, clock=Clock(now=0.0), watch=False)
    agent.grant(-1.0, fenced=True)
    told: list[float] = []
    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    assert Permit(tmp_path / "permit").hold(stop.is_set, told.append, running) is None
    assert len(told) == 1
