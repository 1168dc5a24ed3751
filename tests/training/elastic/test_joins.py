"""The joins of an open round go to the node that may complete it, not to every node: N joins
watched by N agents cost etcd N^2 messages a re-form (docs/benchmarks.md, the rendezvous at
scale)."""

from __future__ import annotations

import json
import socket
import threading
import time
from threading import current_thread

from tests.support.waiting import wait_until
from tests.training.elastic.conftest import CountingEtcd
from training.elastic import etcd_v3
from training.elastic.etcd_v3 import Etcd
from training.elastic.key_copy import Joins
from training.elastic.liveness import Detector, Progress, Verdict
from training.elastic.membership import Membership
from training.elastic.rounds import Me, Timing, View, needs_joins


def open_round(previous: list[str], reports: dict[str, set[str]] | None = None) -> View:
    state = {"round": 2, "members": None, "previous": previous}
    return View(state=state, state_index=5, reports=reports or {})


def never() -> list[str]:
    raise AssertionError("the head of the joins was read, though a previous member serves")


def test_a_previous_member_follows_the_joins_only_when_none_ahead_of_it_serves() -> None:
    view, me = open_round(["a", "b", "c"]), Me("c", 1, 2)
    assert not needs_joins(view, me, lambda n: True, never)  # a completes
    assert not needs_joins(view, me, lambda n: n == "b", never)  # a is gone: b does
    assert needs_joins(view, me, lambda n: n == "c", never)  # a and b are gone
    assert needs_joins(view, Me("a", 1, 2), lambda n: True, never)  # nobody is ahead of a


def test_a_node_named_in_a_report_serves_no_one() -> None:
    # b cannot reach a (or a b): the reports decide who is out, so c may have to complete.
    view = open_round(["a", "b", "c"], reports={"b": {"a"}})
    assert needs_joins(view, Me("c", 1, 2), lambda n: True, never)


def test_a_new_node_looks_at_the_first_joiners_only_when_no_previous_member_serves() -> None:
    me = Me("d", 0, 2)
    assert not needs_joins(open_round(["a"]), me, lambda n: True, never)
    # An afresh group (no previous member alive): the order is the order of the joins.
    head = ["x", "d", "y"]
    assert not needs_joins(open_round(["a"]), me, lambda n: n == "x", lambda: head)
    assert needs_joins(open_round(["a"]), me, lambda n: n == "y", lambda: head)
    # Not among the first joiners read, and none of them serves: it may have to complete.
    assert needs_joins(open_round([]), me, lambda n: False, lambda: ["x", "y"])
    assert not needs_joins(open_round([]), me, lambda n: n == "y", lambda: ["x", "y"])


def test_nothing_to_follow_outside_an_open_round_this_node_joined() -> None:
    assert not needs_joins(open_round(["a"]), Me("a", 1, 1), lambda n: True, never)
    done = View(state={"round": 2, "members": ["a"], "previous": []}, state_index=5)
    assert not needs_joins(done, Me("a", 1, 2), lambda n: True, never)
    assert not needs_joins(View(), Me("a", 0, 0), lambda n: True, never)


def test_only_the_node_that_may_complete_a_round_reads_and_follows_its_joins(
    membership: Membership,
) -> None:
    keys, port = membership, membership.client.client.port
    other, client = Etcd("127.0.0.1", port), CountingEtcd("127.0.0.1", port)
    keys.update_state(lambda s: {"round": 2, "members": None, "previous": ["x", "y", "a"]}, 2)
    for name in ("x", "y"):
        other.txn([], [etcd_v3.put(f"{keys.root}/join/2/{name}", json.dumps({"n": name}))])
    keys.join(2)
    wait_until(lambda: keys.view.state is not None, 10, "the watch to see the open round")
    view = keys.current_view()
    assert view.joined == {}, "the watched copy holds the joins"
    me = Me("a", 1, 2)

    woken = threading.Event()
    joins = Joins(client, Etcd("127.0.0.1", port), keys.root, woken.set)
    assert joins.for_view(view, me, lambda n: n == "y").joined == {}
    assert not joins.following and client.ranges == 0, "a node that waits read the joins"

    seen = joins.for_view(view, me, lambda n: n == "a")  # x and y gone: a completes
    assert list(seen.joined[2]) == ["x", "y", "a"] and joins.following
    other.txn([], [etcd_v3.put(f"{keys.root}/join/2/d", "{}")])
    wait_until(lambda: "d" in joins.joined()[2], 10, "the join of d")
    assert woken.is_set(), "the join did not wake the loop"
    assert client.ranges == 1, "the joins were read again instead of followed"
    assert keys.current_view().joined == {}, "the watched copy took the joins"

    joins.for_view(view, me, lambda n: True)  # x serves again: no more following
    assert not joins.following


def test_the_completer_probes_the_joiners_side_by_side_and_holds_the_answers() -> None:
    # Four joiners that answer only once all four probes are connected at once: probes one
    # after another would each wait out their timeout, unanswered.
    names = ["j0", "j1", "j2", "j3"]
    together = threading.Barrier(len(names))
    listeners = {n: socket.create_server(("127.0.0.1", 0)) for n in names}

    def serve(name: str) -> None:
        conn, _ = listeners[name].accept()
        together.wait(timeout=60)
        with conn:
            conn.sendall(name.encode() + b"\n")

    servers = [threading.Thread(target=serve, args=(n,), daemon=True) for n in names]
    for server in servers:
        server.start()
    told: list[tuple[str, Verdict, threading.Thread]] = []
    detector = Detector(60.0, 60.0, 0.05, lambda n, v, k: told.append((n, v, current_thread())))
    infos = {
        n: {"addr": "127.0.0.1", "port": s.getsockname()[1], "left": False}
        for n, s in listeners.items()
    }
    detector.prefetch(dict(infos))
    assert sorted(n for n, _, _ in told) == names
    assert {v for _, v, _ in told} == {Verdict.ALIVE}, "the probes were not side by side"
    assert {t for _, _, t in told} == {current_thread()}, "a verdict was told off the caller"
    for listener in listeners.values():
        listener.close()  # from now on a probe would be refused
    assert all(detector.reached(n, infos[n]) for n in names), "the held answers were not used"
    assert len(told) == 4, "a held answer was asked again"


def test_a_change_while_the_loop_acts_wakes_its_next_wait_at_once() -> None:
    # The completer's own completion reaches its watch while it still deletes the last
    # round's joins: its next wait must not sleep out the poll (a re-form 50 ms late).
    keys = Membership(
        Etcd("127.0.0.1", 9),  # never asked: not started, no watch
        Etcd("127.0.0.1", 9),
        "wake",
        "c",
        "127.0.0.1",
        Timing(),
        Progress(60),
    )
    seen = keys.changes
    assert not keys.wait_for_change(0.0, seen)
    keys.notify()  # a watch applied an event while the loop acted
    assert keys.wait_for_change(0.0, seen), "the change before the wait was missed"
    assert not keys.wait_for_change(0.0, keys.changes)


def test_a_nodes_own_join_wakes_its_loop(membership: Membership) -> None:
    # Its watch no longer sees joins: without a word, the node that just joined would sleep
    # out the poll before it looked whether it completes the round (a re-form 45 ms late).
    keys = membership
    keys.update_state(lambda s: {"round": 2, "members": None, "previous": []}, 2)
    wait_until(lambda: keys.view.state is not None, 10, "the watch to see the open round")
    seen = keys.changes
    keys.join(2)
    assert keys.wait_for_change(0.0, seen), "the join did not wake the loop"


class BrokenWatch(Etcd):
    """A watch that fails with something no etcd client error covers."""

    def watch(self, *args: object, **kwargs: object):  # type: ignore[no-untyped-def,override]
        raise ValueError("a garbled watch response")
        yield


def test_a_follower_whose_watch_breaks_lets_the_next_look_read_the_joins_again(
    membership: Membership,
) -> None:
    port = membership.client.client.port
    woken = threading.Event()
    joins = Joins(
        Etcd("127.0.0.1", port), BrokenWatch("127.0.0.1", port), membership.root, woken.set
    )
    assert joins.joined() == {}
    wait_until(lambda: not joins.following, 10, "the broken follower to let go")
    assert woken.is_set(), "the loop was not told to look again"


def test_the_fence_follows_the_ttl_a_keep_alive_answers() -> None:
    # etcd's LeaseKeepAliveResponse carries the lease's TTL: the fence counts from that one,
    # not from the TTL of the grant (a lease given more, or an etcd that changed it).
    class Answers(Etcd):
        def keep_alive(self, lease: int) -> int:
            return 9

    keys = Membership(
        Answers("127.0.0.1", 9),
        Etcd("127.0.0.1", 9),
        "ttl",
        "c",
        "127.0.0.1",
        Timing(),
        Progress(60),
    )
    keys.lease = 7  # granted at the asked 5 s
    before = time.monotonic()
    keys.beat()
    assert keys.granted_ttl_s == 9
    assert keys.fence() >= before + 9 - keys.margin_s
