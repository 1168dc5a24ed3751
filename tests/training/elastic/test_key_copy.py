"""The watched copy of a run's keys: kept from the watch's events, never re-read while the
watch runs, and equal to a fresh read of the keys."""

from __future__ import annotations

import json
import time

from lab.local.etcd_server import EmbeddedEtcd
from tests.support.waiting import wait_until
from tests.training.elastic.conftest import CountingEtcd
from training.elastic import etcd_v3
from training.elastic.etcd_v3 import Etcd, Event, KeyValue
from training.elastic.key_copy import KeyCopy
from training.elastic.membership import Membership
from training.elastic.rounds import View

ROOT = "/spot-lab/rendezvous/r"


def kv(rel: str, value: object, create: int, mod: int | None = None) -> KeyValue:
    text = value if isinstance(value, str) else json.dumps(value)
    return KeyValue(f"{ROOT}/{rel}", text, create, mod or create, 0)


def gone(rel: str, revision: int) -> Event:
    return Event(KeyValue(f"{ROOT}/{rel}", "", 0, revision, 0), deleted=True)


def node(addr: str) -> dict[str, object]:
    return {"addr": addr, "port": 1, "left": False}


def test_a_read_orders_each_rounds_joiners_by_the_creation_of_their_keys() -> None:
    copy = KeyCopy(ROOT)
    seen = copy.load(
        [
            kv("join/2/b", {"addr": "b"}, 9),
            kv("nodes/a", node("a"), 3),
            kv("join/2/a", {"addr": "a"}, 5),
            kv("state", {"round": 2, "members": None}, 2, 8),
        ],
        10,
    )
    view = copy.view()
    assert list(view.joined[2]) == ["a", "b"]
    assert view.state == {"round": 2, "members": None} and view.state_index == 8
    assert seen == {"a": node("a")} and view.etcd_index == 10


def test_reports_of_unreachable_peers_are_read_filed_and_withdrawn_through_the_copy() -> None:
    copy = KeyCopy(ROOT)
    copy.load([kv("nodes/a", node("a"), 3), kv("unreachable/a/c", "", 4)], 4)
    assert copy.view().reports == {"a": {"c"}}
    copy.apply([Event(kv("unreachable/b/c", "", 5), deleted=False)])
    assert copy.view().reports == {"a": {"c"}, "b": {"c"}}
    copy.apply([gone("unreachable/a/c", 6)])  # c answered a again
    assert copy.view().reports == {"b": {"c"}}
    copy.load([kv("nodes/a", node("a"), 3)], 7)  # a fresh read after a broken watch
    assert copy.view().reports == {}


def test_events_update_the_copy_and_an_earlier_view_stays_as_it_was() -> None:
    copy = KeyCopy(ROOT)
    copy.load([kv("nodes/a", node("a"), 3), kv("join/1/a", {}, 4)], 4)
    before = copy.view()
    written = copy.apply([Event(kv("nodes/b", node("b"), 5), deleted=False)])
    copy.apply([Event(kv("join/1/b", {}, 6), deleted=False)])
    copy.apply([gone("nodes/a", 7)])  # a's lease expired
    after = copy.view()
    assert written == {"b": node("b")}
    assert set(after.nodes) == {"b"} and list(after.joined[1]) == ["a", "b"]
    assert after.etcd_index == 7
    assert set(before.nodes) == {"a"} and list(before.joined[1]) == ["a"]
    assert before.etcd_index == 4


def test_every_event_of_one_revision_applies_and_older_ones_do_not() -> None:
    copy = KeyCopy(ROOT)
    copy.load([kv("join/1/a", {}, 3), kv("join/1/b", {}, 4), kv("join/2/a", {}, 5)], 6)
    copy.apply([Event(kv("join/1/c", {}, 6), deleted=False)])  # in the read already
    assert "c" not in copy.view().joined[1]
    # The completer's delete of round 1's joins: one revision, one event per key.
    copy.apply([gone("join/1/a", 7), gone("join/1/b", 7)])
    assert list(copy.view().joined) == [2] and copy.revision == 7


def test_a_read_older_than_the_copy_does_not_replace_it() -> None:
    copy = KeyCopy(ROOT)
    copy.load([kv("nodes/a", node("a"), 3)], 3)
    copy.apply([Event(kv("nodes/b", node("b"), 4), deleted=False)])
    assert copy.load([kv("nodes/a", node("a"), 3)], 3) == {}
    assert set(copy.view().nodes) == {"a", "b"} and copy.revision == 4


def fresh(keys: Membership) -> View:
    """The run's keys but the joins, as one range read shows them, through a copy of its own."""
    copy = KeyCopy(keys.root)
    kvs, revision = Etcd("127.0.0.1", keys.client.client.port).range(f"{keys.root}/")
    copy.load([kv for kv in kvs if "/join/" not in kv.key], revision)
    return copy.view()


def same(a: View, b: View) -> bool:
    return (a.state, a.state_index, a.nodes, a.joined) == (
        b.state,
        b.state_index,
        b.nodes,
        b.joined,
    )


def test_the_watch_keeps_the_view_equal_to_a_read_without_reading_again(
    membership: Membership,
) -> None:
    keys, other = membership, Etcd("127.0.0.1", membership.client.client.port)
    assert isinstance(keys.client, CountingEtcd)
    wait_until(lambda: keys.view.etcd_index > 0, 10, "the watch's first read")
    reads = keys.client.ranges
    lease = other.grant(2)
    info = json.dumps(node("b"))
    other.txn([], [etcd_v3.put(f"{keys.root}/nodes/b", info, lease)])
    keys.update_state(lambda s: s, 1)  # creates round 1's state
    keys.join(1)
    other.txn([], [etcd_v3.put(f"{keys.root}/join/1/b", "{}")])
    other.delete(f"{keys.root}/join/1/", prefix=True)
    other.revoke(lease)  # b's key goes with its lease
    wait_until(lambda: same(keys.view, fresh(keys)), 10, "the watched view to equal a read")
    view = keys.current_view()  # holds this node's own writes: no read needed
    assert "b" not in view.nodes and 1 not in view.joined and view.state is not None
    assert keys.client.ranges == reads, "the view was read again instead of watched"


def test_a_wait_returns_the_revision_of_the_first_change_after_the_read(
    etcd_server: EmbeddedEtcd,
) -> None:
    # The agents' exit barrier waits on this: a watch's first response, not a poll.
    client = Etcd("127.0.0.1", etcd_server.client_port)
    prefix = f"/wait-{time.monotonic_ns()}/"
    _, read_at = client.range(prefix)
    client.txn([], [etcd_v3.put(f"{prefix}k", "1")])
    (kv,), _ = client.range(prefix)
    assert client.wait(prefix, read_at, timeout_s=30) == kv.mod_revision
    # Nothing under the prefix since: the wait ends when its time does, with the same revision.
    assert client.wait(prefix, kv.mod_revision, timeout_s=0.5) == kv.mod_revision
