"""The rendezvous handler against a real etcd (v3 API): rounds, leaving, death, slowness, outages.

Handlers run in threads of this process; a "killed" node is one whose probe port refuses and
whose heartbeats stopped, a "frozen" one accepts probes but never answers, as a SIGSTOPped
process or a vanished VM does. The agents' end-to-end behaviour is in test_lab_e2e.py and the
benchmarks; this file pins down the protocol.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousTimeoutError,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.utils.store import barrier

from lab.local.etcd_server import EmbeddedEtcd, free_port
from tests.support.waiting import wait_until
from training.elastic import liveness
from training.elastic.agent_store import StoreTimeout
from training.elastic.closing import FAILED, FINISHED, RunFailedError, RunFinishedError
from training.elastic.etcd_v3 import Etcd
from training.elastic.liveness import ProbeServer, Progress, Verdict, probe
from training.elastic.rendezvous import (
    BACKEND,
    BadInputAfterJoin,
    SpotRendezvousHandler,
    Timing,
    register,
)

TIMING = Timing(keep_alive_interval_s=1, keep_alive_max_attempt=5, join_timeout_s=30)


class Nodes:
    """Handlers of one run, made and cleaned up by the test."""

    def __init__(self, server: EmbeddedEtcd, run_id: str, min_nodes: int, max_nodes: int) -> None:
        self.server, self.run_id = server, run_id
        self.min_nodes, self.max_nodes = min_nodes, max_nodes
        self.timing = TIMING
        self.handlers: list[SpotRendezvousHandler] = []
        self.pool = ThreadPoolExecutor(max_workers=16)

    def new(self, **kwargs: object) -> SpotRendezvousHandler:
        def client() -> Etcd:
            return Etcd("127.0.0.1", self.server.client_port, timeout_s=2)

        handler = SpotRendezvousHandler(
            client(),
            self.run_id,
            self.min_nodes,
            self.max_nodes,
            self.timing,
            local_addr="127.0.0.1",
            watch_client=client(),
            **kwargs,  # type: ignore[arg-type]
        )
        self.handlers.append(handler)
        return handler

    def join(self, *handlers: SpotRendezvousHandler) -> list[RendezvousInfo]:
        futures = [self.pool.submit(h.next_rendezvous) for h in handlers]
        return [f.result(timeout=30) for f in futures]

    def close(self) -> None:
        for handler in self.handlers:
            handler.leave()
        self.pool.shutdown(wait=False, cancel_futures=True)


@pytest.fixture
def nodes(etcd_server: EmbeddedEtcd, request: pytest.FixtureRequest) -> Iterator[Nodes]:
    group = Nodes(etcd_server, f"run-{request.node.name[:40]}-{time.monotonic_ns()}", 2, 3)
    yield group
    group.close()


def kill(handler: SpotRendezvousHandler) -> None:
    """What a SIGKILL leaves behind: a key until its TTL runs out, a port that refuses."""
    handler.keys.stop.set()
    assert handler.keys.probe is not None
    handler.keys.probe.close()


def freeze(handler: SpotRendezvousHandler) -> socket.socket:
    """A SIGSTOPped agent: heartbeats stop, its port accepts but nothing answers."""
    assert handler.keys.probe is not None
    port = handler.keys.probe.port
    handler.keys.stop.set()
    handler.keys.probe.close()
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("", port))
    listener.listen(16)  # the kernel completes handshakes; nobody ever answers
    return listener


def ranks(infos: list[RendezvousInfo]) -> list[tuple[int, int]]:
    return sorted((i.rank, i.world_size) for i in infos)


def _joiners(handler: SpotRendezvousHandler, round_: int) -> list[str]:
    kvs, _ = handler.client.range(f"{handler.root}/join/{round_}/")
    return [kv.key.rsplit("/", 1)[-1] for kv in kvs]


def _state(handler: SpotRendezvousHandler) -> dict:
    kv = handler.client.get(f"{handler.root}/state")
    assert kv is not None
    return json.loads(kv.value)


def _registered(handler: SpotRendezvousHandler) -> set[str]:
    """The nodes whose keys etcd holds now."""
    kvs, _ = handler.client.range(f"{handler.root}/nodes/")
    return {kv.key.rsplit("/", 1)[-1] for kv in kvs}


def _node_key(handler: SpotRendezvousHandler) -> tuple[dict, int]:
    """This node's key as etcd holds it, and the seconds its lease has left."""
    kv = handler.client.get(handler.keys.node_key)
    assert kv is not None and kv.lease, "no key, or a key on no lease"
    return json.loads(kv.value), handler.client.time_to_live(kv.lease)


def test_the_probe_tells_alive_dead_and_unknown() -> None:
    server = ProbeServer("node-a")
    assert probe("127.0.0.1", server.port, "node-a") is Verdict.ALIVE
    assert probe("127.0.0.1", server.port, "node-b") is Verdict.DEAD  # someone else's port
    server.close()
    assert probe("127.0.0.1", server.port, "node-a") is Verdict.DEAD  # refused
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    assert probe("127.0.0.1", listener.getsockname()[1], "x", 0.3) is Verdict.UNKNOWN
    listener.close()


def test_a_wedged_agent_answers_that_it_is_stalled_as_a_frozen_one_would_not_answer() -> None:
    progress = Progress(stall_s=3600)
    server = ProbeServer("node-a", progress)
    try:
        assert probe("127.0.0.1", server.port, "node-a") is Verdict.ALIVE
        progress.stall_s = 0  # its loop made no progress since: the probe thread lives on
        assert probe("127.0.0.1", server.port, "node-a") is Verdict.UNKNOWN
        progress.beat()
        progress.stall_s = 3600
        assert probe("127.0.0.1", server.port, "node-a") is Verdict.ALIVE
    finally:
        server.close()


def test_the_backend_is_registered_under_our_name(etcd_server: EmbeddedEtcd) -> None:
    assert register() == BACKEND
    params = RendezvousParameters(
        backend=BACKEND,
        endpoint=f"127.0.0.1:{etcd_server.client_port}",
        run_id="registry",
        min_nodes=1,
        max_nodes=1,
        keep_alive_interval="2",
        keep_alive_max_attempt="3",
        probe_timeout="0.25",
    )
    handler = rendezvous_handler_registry.create_handler(params)
    assert isinstance(handler, SpotRendezvousHandler)
    assert handler.timing == Timing(2, 3, 1, 900, 0.25, 60) and handler.timing.ttl_s == 6
    # The workers connect to rank 0's agent's store, as torch's own c10d handler's do.
    assert handler.get_backend() == BACKEND and handler.use_agent_store


def test_the_first_round_forms_with_every_node(nodes: Nodes) -> None:
    a, b, c = nodes.new(), nodes.new(), nodes.new()
    infos = nodes.join(a, b, c)
    assert ranks(infos) == [(0, 3), (1, 3), (2, 3)]
    assert a.round == b.round == c.round == 1
    # The workers' bootstrap: every rank reads rank 0's address from the round's store.
    assert (
        len(
            {
                (i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port)
                for i in infos
            }
        )
        == 1
    )
    assert all(h.num_nodes_waiting() == 0 for h in (a, b, c))


def test_a_killed_node_is_dropped_at_once_not_after_its_ttl(nodes: Nodes) -> None:
    # A TTL longer than the joins' timeout: waiting the dead node's key out would fail them.
    nodes.timing = dataclasses.replace(TIMING, keep_alive_interval_s=20)
    a, b, c = nodes.new(), nodes.new(), nodes.new()
    nodes.join(a, b, c)
    kill(c)
    infos = nodes.join(a, b)  # their workers failed: both re-enter
    assert ranks(infos) == [(0, 2), (1, 2)]
    assert a.round == b.round == 2
    assert c.node in _registered(a), "c's key expired: the test proves nothing"


def test_a_member_killed_after_it_answered_a_probe_is_not_taken_for_a_waiting_node(
    nodes: Nodes,
) -> None:
    # A heartbeat longer than the joins' timeout: a's answer is held, and c's key lives, for
    # the whole test, so a round held up by the stale answer would fail the joins.
    nodes.timing = dataclasses.replace(TIMING, keep_alive_interval_s=40)
    a, b, c = nodes.new(), nodes.new(), nodes.new()
    nodes.join(a, b, c)
    # a asked c a moment ago (as while forming a round) and was told alive; then c is killed.
    assert not a._dead(c.node, a.keys.current_view(), probe_live=True)
    kill(c)
    nodes.join(a, b)  # b finds c dead and completes the round; a joins it
    # Until its TTL runs out c's key is still there, outside the new round's members. a must
    # not count it as a node waiting to join: that would re-form the new group at once.
    wait_until(lambda: (a.keys.view.state or {}).get("members") is not None, 5)
    assert c.node in a.keys.view.nodes, "c's key expired before the check: proves nothing"
    assert a.num_nodes_waiting() == 0 and b.num_nodes_waiting() == 0


def test_a_node_that_leaves_is_not_waited_for(nodes: Nodes) -> None:
    a, b, c = nodes.new(), nodes.new(), nodes.new()
    nodes.join(a, b, c)
    futures = [nodes.pool.submit(h.next_rendezvous) for h in (a, b)]
    wait_until(lambda: {a.node, b.node} <= set(_joiners(a, 2)), 10)
    c.leave()
    infos = [f.result(timeout=10) for f in futures]
    assert ranks(infos) == [(0, 2), (1, 2)]


def test_a_frozen_member_is_detected_after_its_ttl_and_the_group_reforms(nodes: Nodes) -> None:
    a, b, c = nodes.new(), nodes.new(), nodes.new()
    nodes.join(a, b, c)
    listener = freeze(c)
    try:
        wait_until(lambda: a.num_nodes_waiting() > 0, 10)
        assert c.node not in _registered(a)  # not before its key expired
        infos = nodes.join(a, b)
        assert ranks(infos) == [(0, 2), (1, 2)]
    finally:
        listener.close()


def test_a_slow_node_whose_key_expired_but_answers_is_not_dead(nodes: Nodes) -> None:
    a, b, c = nodes.new(), nodes.new(), nodes.new()
    nodes.join(a, b, c)
    c.keys.stop.set()  # its heartbeats stop (a starved agent); its probe still answers
    wait_until(lambda: c.node not in _registered(a), 10)
    wait_until(lambda: c.node not in a.keys.view.nodes, 10)  # a's view has it expired too
    assert a.num_nodes_waiting() == 0 and b.num_nodes_waiting() == 0
    # A new round waits for it too, until it joins: completed without it (min_nodes is 2),
    # the round would leave c waiting, and c's join would time out.
    future = nodes.pool.submit(a.next_rendezvous)
    wait_until(lambda: a.node in _joiners(a, 2), 10)
    infos = nodes.join(b, c) + [future.result(timeout=10)]
    assert ranks(infos) == [(0, 3), (1, 3), (2, 3)]


def test_a_new_node_is_seen_waiting_and_joins_the_next_round(nodes: Nodes) -> None:
    a, b = nodes.new(), nodes.new()
    first = [i.rank for i in nodes.join(a, b)]
    c = nodes.new()
    future = nodes.pool.submit(c.next_rendezvous)
    wait_until(lambda: a.num_nodes_waiting() > 0 and b.num_nodes_waiting() > 0, 5)
    infos = nodes.join(a, b) + [future.result(timeout=10)]
    assert ranks(infos) == [(0, 3), (1, 3), (2, 3)]
    assert a.round == 2
    # The survivors keep their order: rank 0 (the durable committer) stays where it was.
    assert [i.rank for i in infos[:2]] == first and infos[2].rank == 2


def test_a_new_node_cannot_open_a_round_while_the_members_live(nodes: Nodes) -> None:
    nodes.max_nodes = 2  # the group is full: the newcomer only waits
    a, b = nodes.new(), nodes.new()
    nodes.join(a, b)
    c = nodes.new()
    nodes.pool.submit(c.next_rendezvous)
    wait_until(lambda: c.node in a.keys.view.nodes, 10)  # registered, and seen
    assert a.num_nodes_waiting() == 0  # full: nobody restarts for it
    kill(a)
    kill(b)  # every member gone: once their keys expire it may open the next round
    wait_until(lambda: _state(c)["round"] == 2, TIMING.ttl_s + 10)
    assert set(_state(c)["previous"]) == {a.node, b.node}
    c.leave()


def test_an_etcd_outage_pauses_nothing_until_the_fence_then_the_group_re_forms(
    nodes: Nodes,
) -> None:
    """Until the fence (the TTL past the last keep-alive etcd answered, less one keep-alive's
    timeout and etcd's expiry check) the group trains on; past it each node says its group
    must re-form (its workers stop), and once etcd answers the two form the next round."""
    a, b = nodes.new(), nodes.new()
    nodes.join(a, b)
    server = nodes.server
    server.stop()
    try:
        wait_until(lambda: a.keys.etcd_down_since is not None, 10)
        while time.monotonic() < min(a.keys.fence(), b.keys.fence()) - 0.2:
            assert a.num_nodes_waiting() == 0 and b.num_nodes_waiting() == 0
            time.sleep(0.05)
        wait_until(lambda: a.num_nodes_waiting() > 0 and b.num_nodes_waiting() > 0, 10)
    finally:
        server.start()
    assert ranks(nodes.join(a, b)) == [(0, 2), (1, 2)]
    assert a.round == b.round == 2


def test_a_ttl_the_fence_would_eat_is_refused_naming_the_settings(
    etcd_server: EmbeddedEtcd,
) -> None:
    with pytest.raises(ValueError, match="keep_alive_max_attempt"):
        SpotRendezvousHandler(
            Etcd("127.0.0.1", etcd_server.client_port, timeout_s=2),
            "short-ttl",
            1,
            1,
            Timing(keep_alive_interval_s=1, keep_alive_max_attempt=1),
        )


def test_a_round_that_cannot_reach_etcd_gives_up_for_a_new_pod() -> None:
    port = free_port()  # nothing listens: etcd is gone for good
    handler = SpotRendezvousHandler(
        Etcd("127.0.0.1", port, timeout_s=1),
        "no-etcd",
        1,
        1,
        dataclasses.replace(TIMING, outage_timeout_s=2),
        local_addr="127.0.0.1",
    )
    handler.keys.probe = ProbeServer(handler.node)  # registered before etcd went away
    with pytest.raises(RendezvousConnectionError, match="etcd unreachable") as raised:
        handler.next_rendezvous()
    down = re.search(r"unreachable for (\d+) s", str(raised.value))
    assert down is not None and int(down.group(1)) >= 2  # it retried for the outage timeout
    handler.keys.probe.close()


def test_only_the_agent_closes_the_rendezvous(
    nodes: Nodes, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    a = nodes.new()
    nodes.min_nodes = 1
    a.min_nodes = 1
    nodes.join(a)
    assert a.shutdown() is True and not a.is_closed()  # what torch's launcher calls
    a.settle(close=False)
    assert not a.is_closed()
    b = nodes.new()
    b.settle(close=True, why=FINISHED)
    assert a.is_closed() and _state(a)["closed"] == FINISHED
    nodes.new().settle(close=True, why=FAILED)  # a peer that ended otherwise just after
    assert _state(a)["closed"] == FINISHED  # the first closing's reason stays
    late = nodes.new()
    with pytest.raises(RunFinishedError):
        late.next_rendezvous()
    with caplog.at_level(logging.INFO, logger="training.elastic.rendezvous"):
        late.settle(close=False)  # it neither reopens nor closes the run again
    assert _state(a)["closed"] == FINISHED and "left open" not in caplog.text


@pytest.mark.parametrize(
    ("closed", "raised"),
    [(FAILED, RunFailedError), (True, RendezvousClosedError)],
    ids=["failed-for-good", "closed-with-no-reason"],
)
def test_a_late_node_reads_why_the_run_closed(
    nodes: Nodes, closed: object, raised: type[Exception]
) -> None:
    # ``True``: the key as agents wrote it before they kept the reason.
    a = nodes.new()
    a.keys.update_state(lambda s: {**s, "closed": closed}, 0)
    with pytest.raises(raised) as error:
        nodes.new().next_rendezvous()
    assert type(error.value) is raised and not isinstance(error.value, RunFinishedError)


def test_a_verdict_stops_the_next_round_before_it_joins(nodes: Nodes, tmp_path: Path) -> None:
    verdict = tmp_path / "verdict"
    verdict.write_text("bad checkpoint")
    handler = nodes.new(verdict=verdict)
    with pytest.raises(BadInputAfterJoin, match="bad checkpoint"):
        handler.next_rendezvous()
    assert handler.keys.probe is None  # never registered


def test_the_round_is_written_for_the_workers(nodes: Nodes, tmp_path: Path) -> None:
    files = [tmp_path / "a", tmp_path / "b"]
    a, b = (nodes.new(round_file=f) for f in files)
    nodes.join(a, b)
    assert [f.read_text() for f in files] == ['{"round": 1, "members": 2}'] * 2


def test_a_completed_round_drops_the_older_rounds_join_keys(nodes: Nodes) -> None:
    a, b = nodes.new(), nodes.new()
    nodes.join(a, b)
    nodes.join(a, b)  # round 2: round 1's joins are gone, the keys stay one round big
    joined = {kv.key.split("/")[-2] for kv in a.client.range(f"{a.root}/join/")[0]}
    assert joined == {"2"} and a.round == 2


@pytest.mark.parametrize("how", ["evicted", "killed"])
def test_a_joiner_lost_before_the_round_completes_is_not_made_a_member(
    nodes: Nodes, how: str
) -> None:
    # A second eviction while the group re-forms: a opened round 2 and joined it, then went
    # too, before the slow survivors came. Made a member, it would be the rank the others wait
    # for in torch's RendezvousStoreInfo.build (300 s, then LookupError: exit 1).
    a, b, c = nodes.new(), nodes.new(), nodes.new()
    nodes.join(a, b, c)
    nodes.pool.submit(a.next_rendezvous)
    wait_until(lambda: a.node in _joiners(a, 2), 10)
    a.leave() if how == "evicted" else kill(a)
    infos = nodes.join(b, c)
    assert ranks(infos) == [(0, 2), (1, 2)]
    assert a.node not in _state(b)["members"]


def test_a_wedged_agent_is_taken_for_dead_and_the_group_reforms_without_it(
    nodes: Nodes,
) -> None:
    # c's agent is stuck (its main loop never comes back) while its threads live on: its
    # probe thread answers and its heartbeat thread refreshes its key. Liveness must mean
    # progress: the next round may not wait for c until its join timeout.
    params = RendezvousParameters(
        BACKEND, "unused:2379", nodes.run_id, 2, 3, stall_timeout="4", join_timeout="30"
    )
    nodes.timing = Timing.from_params(params)
    a, b, c = nodes.new(), nodes.new(), nodes.new()
    nodes.join(a, b, c)
    infos = nodes.join(a, b)  # c never calls into its handler again
    assert ranks(infos) == [(0, 2), (1, 2)]


def test_a_later_round_that_times_out_does_not_say_too_few_nodes_started(nodes: Nodes) -> None:
    # Only the first round's timeout means "the pool could not grow" (the agent closes the
    # run and fails the job). A later round that cannot complete must leave the run open.
    nodes.timing = dataclasses.replace(TIMING, join_timeout_s=2)
    a, b = nodes.new(), nodes.new()
    nodes.join(a, b)
    b.leave()  # min_nodes is 2 and no node comes
    with pytest.raises(RendezvousError) as raised:
        a.next_rendezvous()
    assert not isinstance(raised.value, RendezvousTimeoutError), raised.value


def test_the_first_rounds_timeout_says_too_few_nodes_started(nodes: Nodes) -> None:
    nodes.timing = dataclasses.replace(TIMING, join_timeout_s=1)
    with pytest.raises(RendezvousTimeoutError, match="fewer than 2 nodes"):
        nodes.new().next_rendezvous()


def test_a_heartbeat_in_flight_when_the_node_leaves_keeps_it_left(nodes: Nodes) -> None:
    a = nodes.new()
    a.keys.start()
    a.leave()
    a.keys.beat()  # the heartbeat thread's keep-alive, sent just before leave() stopped it
    info, ttl = _node_key(a)
    assert info["left"] is True
    assert ttl > TIMING.ttl_s  # on leave()'s own lease, not the heartbeat's


def test_a_heartbeat_that_found_its_key_expired_never_undoes_a_leave(
    nodes: Nodes, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = nodes.new()
    a.keys.start()
    a.leave()

    def expired(lease: int) -> int:
        return -1  # the lease had expired when this keep-alive reached etcd

    monkeypatch.setattr(a.client, "keep_alive", expired)
    a.keys.beat()  # ... and its re-registration lands after leave()'s write
    assert _node_key(a)[0]["left"] is True


def test_a_member_lost_right_after_its_round_completed_holds_nobody_up(
    nodes: Nodes, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The victim, rank 0, completed the round and froze at once, before it did anything else
    # for it (its workers' store never came up). torch's RendezvousStoreInfo.build would make
    # the survivor wait 300 s for the MASTER_ADDR rank 0 writes; the round's state carries it
    # instead, and the agents' own store is on etcd, not in the frozen rank 0.
    nodes.timing = dataclasses.replace(TIMING, keep_alive_interval_s=3)  # a 6 s TTL
    nodes.min_nodes = 1
    handlers = {h.node: h for h in (nodes.new(), nodes.new(), nodes.new())}
    nodes.join(*handlers.values())
    order = _state(next(iter(handlers.values())))["members"]
    victim, survivor, evicted = (handlers[n] for n in order)  # the victim is rank 0
    frozen: list[socket.socket] = []
    never, victim_frozen = threading.Event(), threading.Event()

    def freeze_right_after_completing(state: dict, index: int) -> None:
        frozen.append(freeze(victim))  # its key outlives it by a TTL, its probe goes silent
        victim_frozen.set()
        never.wait()

    def after_the_victim_froze(state: dict, index: int, member=survivor._member) -> object:
        assert victim_frozen.wait(10), "the victim never completed the round"
        return member(state, index)

    monkeypatch.setattr(victim, "_member", freeze_right_after_completing)
    monkeypatch.setattr(survivor, "_member", after_the_victim_froze)
    evicted.leave()
    survivor_joins = nodes.pool.submit(survivor.next_rendezvous)
    nodes.pool.submit(victim.next_rendezvous)
    try:
        info = survivor_joins.result(timeout=30)
        assert (info.rank, info.world_size) == (1, 2)
        assert _state(survivor)["members"] == [victim.node, survivor.node]
        # torch's exit barrier on the agents' store gives up; it does not hang on the victim.
        with pytest.raises(StoreTimeout):
            barrier(info.store, 2, key_prefix="exit", barrier_timeout=1)
        # Once the victim's key expired, the survivor's monitor loop re-forms the group.
        wait_until(lambda: survivor.num_nodes_waiting() > 0, 30)
        (alone,) = nodes.join(survivor)
        assert (alone.rank, alone.world_size, survivor.round) == (0, 1, 3)
    finally:
        never.set()
        for listener in frozen:
            listener.close()


def test_the_workers_store_is_served_by_rank_0_on_the_port_the_round_published(
    nodes: Nodes,
) -> None:
    a, b = nodes.new(), nodes.new()
    infos = nodes.join(a, b)
    master = infos[0].bootstrap_store_info
    assert (master.master_addr, master.master_port) == tuple(_state(a)["master"].values())
    # The agents share their own store (on etcd): what one writes, the other reads.
    infos[0].store.set("k", "v")
    assert infos[1].store.get("k") == b"v"
    # A worker (a client, no prefix, as torch's _create_c10d_store makes it) reaches rank 0's.
    worker = TCPStore(master.master_addr, master.master_port, is_master=False)
    worker.set("w", "1")
    assert worker.get("w") == b"1"
    # The next round's store is a new one on a new port, and the old one is gone.
    old_port = master.master_port
    del worker
    nodes.join(a, b)
    assert _state(a)["master"]["port"] != old_port
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", old_port), timeout=2).close()


def test_a_node_whose_probe_was_refused_once_and_then_answers_is_in_the_next_round(
    nodes: Nodes, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A REJECT rule, a route flap: one probe refused (RST) although the agent lives. With its
    # key fresh that is a report, not a death; once it answered for the heal time the report
    # goes, and the node is in the next round.
    handlers = {h.node: h for h in (nodes.new(), nodes.new(), nodes.new())}
    nodes.join(*handlers.values())
    order = _state(next(iter(handlers.values())))["members"]
    completer, _, flapped = (handlers[n] for n in order)  # rank 0 completes the next round
    real_probe, refused = liveness.probe, []

    def refused_once(addr: str, port: int, node_id: str, timeout_s: float) -> Verdict:
        if node_id == flapped.node and not refused:
            refused.append(node_id)
            return Verdict.DEAD
        return real_probe(addr, port, node_id, timeout_s)

    monkeypatch.setattr(liveness, "probe", refused_once)
    completer.detector.forget()  # as a new round does: ask again
    view = completer.keys.current_view()
    assert not completer._dead(flapped.node, view, probe_live=True)
    assert refused and _reports(completer) == {(completer.node, flapped.node)}

    def healed() -> bool:
        completer.detector.forget()
        completer.detector.reached(flapped.node, view.nodes[flapped.node])
        return not _reports(completer)

    wait_until(healed, 10, "the report withdrawn once the node answered for the heal time")
    infos = nodes.join(*handlers.values())  # the three re-form
    assert ranks(infos) == [(0, 3), (1, 3), (2, 3)]


def _reports(handler: SpotRendezvousHandler) -> set[tuple[str, str]]:
    """The reports etcd holds now, as (reporter, target)."""
    kvs, _ = handler.client.range(f"{handler.root}/unreachable/")
    return {tuple(kv.key.rsplit("/", 2)[-2:]) for kv in kvs}  # type: ignore[misc]


def test_a_member_cut_off_while_its_key_is_fresh_is_reported_until_it_answers_again(
    nodes: Nodes, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A node cut off from its peers but not from etcd: its key stays fresh, its probe silent.
    a, b = nodes.new(), nodes.new()
    nodes.join(a, b)
    real_probe = liveness.probe

    def cut_off_b(addr: str, port: int, node_id: str, timeout_s: float) -> Verdict:
        if node_id == b.node:
            return Verdict.UNREACHABLE  # no SYN-ACK: the network, not b's process
        return real_probe(addr, port, node_id, timeout_s)

    monkeypatch.setattr(liveness, "probe", cut_off_b)
    a.detector.forget()
    view = a.keys.current_view()
    assert not a._dead(b.node, view, probe_live=True)  # not dead: its key is fresh
    assert not a.detector.reached(b.node, view.nodes[b.node])  # but no member a completes with
    assert _reports(a) == {(a.node, b.node)}
    # The ring: a watches b, the next member; no way to b re-forms the group, spending no
    # restart, long before the workers' collective would time out.
    wait_until(lambda: a.num_nodes_waiting() > 0, 10, "a to re-form without the silent b")
    monkeypatch.setattr(liveness, "probe", real_probe)

    def answering() -> bool:
        a.detector.forget()
        assert a.detector.reached(b.node, a.keys.current_view().nodes[b.node])
        return not _reports(a)

    wait_until(answering, 10, "the report withdrawn once b answered for the heal time")


def test_a_frozen_agent_is_no_reason_for_the_ring_its_key_decides(nodes: Nodes) -> None:
    # Its kernel still completes the handshake; only the network's silence (no SYN-ACK, no
    # route) is a partition. An agent stopped while its workers train on must not re-form the
    # group before its key expires (tests/training/test_agent_stop.py).
    nodes.timing = dataclasses.replace(TIMING, keep_alive_max_attempt=60)  # the key outlives it
    a, b = nodes.new(), nodes.new()
    nodes.join(a, b)
    listener = freeze(b)
    try:
        view = a.keys.current_view()
        a.detector.retry_s = 0.0  # every look probes afresh: three silent probes in a row
        for _ in range(3):
            assert not a.detector.unanswered(b.node, view.nodes[b.node])
        assert a.num_nodes_waiting() == 0
    finally:
        listener.close()
