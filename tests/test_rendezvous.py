"""The rendezvous handler against a real etcd 3.5: rounds, leaving, death, slowness, outages.

Handlers run in threads of this process; a "killed" node is one whose probe port refuses and
whose heartbeats stopped, a "frozen" one accepts probes but never answers, as a SIGSTOPped
process or a vanished VM does. The agents' end-to-end behaviour is in test_lab_e2e.py and the
benchmarks; this file pins down the protocol.
"""

from __future__ import annotations

import dataclasses
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import etcd
import pytest
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousInfo,
    RendezvousParameters,
    rendezvous_handler_registry,
)

from lab.local.etcd_server import EmbeddedEtcd, find_etcd_binary, free_port
from training.liveness import ProbeServer, Verdict, probe
from training.rendezvous import (
    BACKEND,
    BadInputAfterJoin,
    SpotRendezvousHandler,
    Timing,
    register,
)

TIMING = Timing(keep_alive_interval_s=1, keep_alive_max_attempt=2, join_timeout_s=30)


@pytest.fixture(scope="module")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedEtcd]:
    root = tmp_path_factory.mktemp("etcd")
    with EmbeddedEtcd(find_etcd_binary(), root / "data", root / "etcd.log") as server:
        yield server


class Nodes:
    """Handlers of one run, made and cleaned up by the test."""

    def __init__(self, server: EmbeddedEtcd, run_id: str, min_nodes: int, max_nodes: int) -> None:
        self.server, self.run_id = server, run_id
        self.min_nodes, self.max_nodes = min_nodes, max_nodes
        self.timing = TIMING
        self.handlers: list[SpotRendezvousHandler] = []
        self.pool = ThreadPoolExecutor(max_workers=16)

    def new(self, **kwargs: object) -> SpotRendezvousHandler:
        def client() -> etcd.Client:
            return etcd.Client("127.0.0.1", self.server.client_port, read_timeout=2)

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
    handler._stop.set()
    assert handler._probe is not None
    handler._probe.close()


def freeze(handler: SpotRendezvousHandler) -> socket.socket:
    """A SIGSTOPped agent: heartbeats stop, its port accepts but nothing answers."""
    assert handler._probe is not None
    port = handler._probe.port
    handler._stop.set()
    handler._probe.close()
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("", port))
    listener.listen(16)  # the kernel completes handshakes; nobody ever answers
    return listener


def ranks(infos: list[RendezvousInfo]) -> list[tuple[int, int]]:
    return sorted((i.rank, i.world_size) for i in infos)


def wait_until(predicate: object, timeout_s: float) -> float:
    started = time.monotonic()
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() - started < timeout_s, "condition not reached in time"
        time.sleep(0.02)
    return time.monotonic() - started


def test_the_probe_tells_alive_dead_and_unknown() -> None:
    server = ProbeServer("node-a")
    assert probe("127.0.0.1", server.port, "node-a") is Verdict.ALIVE
    assert probe("127.0.0.1", server.port, "node-b") is Verdict.DEAD  # someone else's port
    server.close()
    assert probe("127.0.0.1", server.port, "node-a") is Verdict.DEAD  # refused
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    started = time.monotonic()
    assert probe("127.0.0.1", listener.getsockname()[1], "x", 0.3) is Verdict.UNKNOWN
    assert time.monotonic() - started < 1.0
    listener.close()


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
    assert handler.get_backend() == BACKEND and not handler.use_agent_store


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
    a, b, c = nodes.new(), nodes.new(), nodes.new()
    nodes.join(a, b, c)
    kill(c)
    started = time.monotonic()
    infos = nodes.join(a, b)  # their workers failed: both re-enter
    took = time.monotonic() - started
    assert ranks(infos) == [(0, 2), (1, 2)]
    assert a.round == b.round == 2
    assert took < TIMING.ttl_s, f"{took:.2f} s: the dead node's key was waited out"


def test_a_member_killed_after_it_answered_a_probe_is_not_taken_for_a_waiting_node(
    nodes: Nodes,
) -> None:
    # A longer heartbeat: a's answer is held, and c's key lives, for the whole test.
    nodes.timing = dataclasses.replace(TIMING, keep_alive_interval_s=5)
    a, b, c = nodes.new(), nodes.new(), nodes.new()
    nodes.join(a, b, c)
    # a asked c a moment ago (as while forming a round) and was told alive; then c is killed.
    assert not a._is_dead(c.node, a._current_view(), probe_live=True)
    kill(c)
    started = time.monotonic()
    nodes.join(a, b)  # b finds c dead and completes the round; a joins it
    # Nor may a stale answer hold the round up until it runs out.
    assert time.monotonic() - started < nodes.timing.keep_alive_interval_s
    # Until its TTL runs out c's key is still there, outside the new round's members. a must
    # not count it as a node waiting to join: that would re-form the new group at once.
    wait_until(lambda: (a._view.state or {}).get("members") is not None, 5)
    assert c.node in a._view.nodes, "c's key expired before the check: the test proves nothing"
    assert a.num_nodes_waiting() == 0 and b.num_nodes_waiting() == 0


def test_a_node_that_leaves_is_not_waited_for(nodes: Nodes) -> None:
    a, b, c = nodes.new(), nodes.new(), nodes.new()
    nodes.join(a, b, c)
    futures = [nodes.pool.submit(h.next_rendezvous) for h in (a, b)]
    time.sleep(0.3)
    assert not any(f.done() for f in futures)  # c is alive: its round waits for it
    left_at = time.monotonic()
    c.leave()
    infos = [f.result(timeout=10) for f in futures]
    assert ranks(infos) == [(0, 2), (1, 2)]
    assert time.monotonic() - left_at < 1.0


def test_a_frozen_member_is_detected_after_its_ttl_and_the_group_reforms(nodes: Nodes) -> None:
    a, b, c = nodes.new(), nodes.new(), nodes.new()
    nodes.join(a, b, c)
    listener = freeze(c)
    try:
        waited = wait_until(lambda: a.num_nodes_waiting() > 0, 10)
        assert waited >= TIMING.keep_alive_interval_s  # not before its key could expire
        infos = nodes.join(a, b)
        assert ranks(infos) == [(0, 2), (1, 2)]
    finally:
        listener.close()


def test_a_slow_node_whose_key_expired_but_answers_is_not_dead(nodes: Nodes) -> None:
    a, b, c = nodes.new(), nodes.new(), nodes.new()
    nodes.join(a, b, c)
    c._stop.set()  # its heartbeats stop (a starved agent); its probe still answers
    time.sleep(TIMING.ttl_s + 1.5)  # the key has expired by now
    assert f"{c.root}/nodes/{c.node}" not in {
        leaf.key for leaf in a.client.read(a.root, recursive=True).leaves
    }
    assert a.num_nodes_waiting() == 0 and b.num_nodes_waiting() == 0
    # A new round waits for it too, until it joins.
    future = nodes.pool.submit(a.next_rendezvous)
    time.sleep(0.5)
    assert not future.done()
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
    future = nodes.pool.submit(c.next_rendezvous)
    time.sleep(1.0)
    assert not future.done()
    assert a.num_nodes_waiting() == 0  # full: nobody restarts for it
    state = a._read_state()[0]
    assert state is not None and state["round"] == 1 and c.node not in state["members"]
    kill(a)
    kill(b)  # every member gone: now it may open the next round (and wait for min nodes)
    wait_until(lambda: (a._read_state()[0] or {}).get("round") == 2, 5)
    c.leave()


def test_training_goes_on_through_an_etcd_outage(nodes: Nodes) -> None:
    a, b = nodes.new(), nodes.new()
    nodes.join(a, b)
    server = nodes.server
    server.stop()
    try:
        deadline = time.monotonic() + TIMING.ttl_s + 2
        while time.monotonic() < deadline:
            assert a.num_nodes_waiting() == 0 and b.num_nodes_waiting() == 0
            time.sleep(0.1)
    finally:
        server.start()
    # Back with every key expired: the probes answer, nobody is taken for dead.
    deadline = time.monotonic() + TIMING.ttl_s + 2
    while time.monotonic() < deadline:
        assert a.num_nodes_waiting() == 0 and b.num_nodes_waiting() == 0
        time.sleep(0.1)
    keys = {leaf.key for leaf in a.client.read(a.root, recursive=True).leaves}
    assert f"{a.root}/nodes/{a.node}" in keys and f"{b.root}/nodes/{b.node}" in keys


def test_a_round_that_cannot_reach_etcd_gives_up_for_a_new_pod() -> None:
    port = free_port()  # nothing listens: etcd is gone for good
    handler = SpotRendezvousHandler(
        etcd.Client("127.0.0.1", port, read_timeout=1),
        "no-etcd",
        1,
        1,
        dataclasses.replace(TIMING, outage_timeout_s=2),
        local_addr="127.0.0.1",
    )
    handler._probe = ProbeServer(handler.node)  # registered before etcd went away
    started = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match="etcd unreachable"):
        handler.next_rendezvous()
    assert 2 <= time.monotonic() - started < 10
    handler._probe.close()


def test_only_the_agent_closes_the_rendezvous(nodes: Nodes, tmp_path: Path) -> None:
    a = nodes.new()
    nodes.min_nodes = 1
    a.min_nodes = 1
    nodes.join(a)
    assert a.shutdown() is True and not a.is_closed()  # what torch's launcher calls
    a.settle(close=False)
    assert not a.is_closed()
    b = nodes.new()
    b.settle(close=True)
    assert a.is_closed()
    late = nodes.new()
    with pytest.raises(RendezvousClosedError):
        late.next_rendezvous()


def test_a_verdict_stops_the_next_round_before_it_joins(nodes: Nodes, tmp_path: Path) -> None:
    verdict = tmp_path / "verdict"
    verdict.write_text("bad checkpoint")
    handler = nodes.new(verdict=verdict)
    with pytest.raises(BadInputAfterJoin, match="bad checkpoint"):
        handler.next_rendezvous()
    assert handler._probe is None  # never registered


def test_the_round_is_written_for_the_workers(nodes: Nodes, tmp_path: Path) -> None:
    files = [tmp_path / "a", tmp_path / "b"]
    a, b = (nodes.new(round_file=f) for f in files)
    nodes.join(a, b)
    assert [f.read_text() for f in files] == ['{"round": 1, "members": 2}'] * 2


def test_the_store_directory_exists_before_the_first_round(nodes: Nodes) -> None:
    # torch's EtcdStore.get watches from index 0 when its directory is missing, and a rank
    # that read between rank 0's two writes then waited out the store's 300 s timeout.
    a = nodes.new()
    a._start()
    assert a.client.read(a._store_dir).dir


def test_a_completed_round_drops_the_older_rounds_join_keys(nodes: Nodes) -> None:
    a, b = nodes.new(), nodes.new()
    nodes.join(a, b)
    nodes.join(a, b)  # round 2: round 1's joins are gone, the directory stays one round big
    joined = {leaf.key.split("/")[-2] for leaf in a.client.read(a.root, recursive=True).leaves}
    assert "1" not in joined and a.round == 2
