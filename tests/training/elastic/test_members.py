"""An agent's etcd client over several members (training/elastic/etcd_v3.py, ``Members``): on a
real three-member etcd, a member without a leader refuses at once and the client moves on, and
real agents train on when the member they were given, the leader, freezes.

What etcd does here is what its source says: with the require-leader metadata a member with no
leader refuses a request (``server/etcdserver/api/v3rpc/interceptor.go``); without it the same
read waits etcd's request timeout (7 s at the defaults) and a watch stays open and silent.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from torch.distributed.elastic.rendezvous import RendezvousParameters

from lab.local.etcd_server import EmbeddedEtcd, etcd_members, find_etcd_binary
from lab.report.outcomes import groups_at_once
from tests.support.elastic_cluster import TINY, Cluster
from tests.support.loopback import loopback_server
from training.data.cifar10 import write_synthetic_cifar10
from training.elastic.etcd_v3 import NO_LEADER, Etcd, EtcdError, Members, Tls, put
from training.elastic.rendezvous import _client
from training.records import RESUMED

HOST = "127.0.0.1"


@pytest.fixture
def leaderless(tmp_path: Path, etcd: None) -> Iterator[EmbeddedEtcd]:
    """Member m2 of three, the other two frozen: it runs, and has no leader."""
    with etcd_members(find_etcd_binary(), tmp_path) as (m0, m1, m2):
        os.kill(m0.pid, signal.SIGSTOP)  # type: ignore[arg-type]
        os.kill(m1.pid, signal.SIGSTOP)  # type: ignore[arg-type]
        alone = Etcd(HOST, m2.client_port, timeout_s=2)
        deadline = time.monotonic() + 60  # m2 finds its leader gone after an election timeout

        def says_no_leader() -> bool:
            try:
                alone.range("/probe/")
            except EtcdError as error:
                return NO_LEADER in str(error.detail_text)
            return False

        while not says_no_leader():
            assert time.monotonic() < deadline, "member m2 never said it had no leader"
            time.sleep(0.1)
        yield m2


def test_a_member_with_no_leader_refuses_and_the_next_member_answers_the_same_request(
    leaderless: EmbeddedEtcd, etcd_server: EmbeddedEtcd, caplog: pytest.LogCaptureFixture
) -> None:
    # The second endpoint stands for the members that kept the quorum: an etcd that answers.
    members = Members([(HOST, leaderless.client_port), (HOST, etcd_server.client_port)])
    # A timeout longer than the pytest run's: a client that waited for m2 would fail the test.
    client = Etcd(HOST, leaderless.client_port, timeout_s=600, members=members)
    done, _ = client.txn([], [put("/members-test/k", "v")])
    assert done and client.get("/members-test/k").value == "v"  # type: ignore[union-attr]
    assert members.at() == 1 and client.endpoint == f"{HOST}:{etcd_server.client_port}"
    assert client.another().endpoint == client.endpoint  # the agent's other threads moved too
    assert f"etcd member {HOST}:{leaderless.client_port} left (no leader)" in caplog.text


def test_a_watch_on_a_member_with_no_leader_fails_instead_of_staying_silent(
    leaderless: EmbeddedEtcd, etcd_server: EmbeddedEtcd
) -> None:
    members = Members([(HOST, leaderless.client_port), (HOST, etcd_server.client_port)])
    client = Etcd(HOST, leaderless.client_port, timeout_s=2, members=members)
    # Silent, the stream would end after idle_s with nothing; it ends at once with the error.
    with pytest.raises(EtcdError, match=NO_LEADER):
        list(client.watch("/members-test/", after=0, idle_s=600))
    assert members.at() == 1  # the watcher's next stream goes to the next member


def test_a_member_that_does_not_answer_fails_one_request_and_the_next_goes_on(
    etcd_server: EmbeddedEtcd, caplog: pytest.LogCaptureFixture
) -> None:
    # A member that takes the connection and never answers (a frozen VM's kernel queues it).
    with socket.create_server((HOST, 0), backlog=8) as silent:
        port = silent.getsockname()[1]
        members = Members([(HOST, port), (HOST, etcd_server.client_port)])
        client = Etcd(HOST, port, timeout_s=0.5, members=members)
        # Sent and unanswered, it may have been applied: not sent again, the caller decides.
        with pytest.raises(EtcdError):
            client.txn([], [put("/members-test/once", "1")])
        assert members.at() == 1 and "left (timed out)" in caplog.text
        assert client.range("/members-test/")[0] is not None
        # A read changes nothing if applied twice: it goes on within the call.
        again = Etcd(HOST, port, timeout_s=0.5, members=Members(members.endpoints))
        assert again.range("/members-test/")[1] > 0 and again.members.at() == 1


def test_a_keep_alive_leaves_a_silent_member_within_its_own_timeout(
    etcd_server: EmbeddedEtcd,
) -> None:
    # A frozen leader held a keep-alive for the general request timeout: longer than the
    # fence leaves, so the node fenced itself though the other members answered. Here that
    # timeout is longer than the pytest run's: only the keep-alive's own lets this pass.
    with socket.create_server((HOST, 0), backlog=8) as silent:
        port = silent.getsockname()[1]
        members = Members([(HOST, etcd_server.client_port), (HOST, port)])
        granting = Etcd(HOST, etcd_server.client_port, timeout_s=5, members=members)
        lease, ttl = granting.grant_ttl(5)
        members.leave(0, "test: the next request starts at the silent member")
        client = Etcd(HOST, port, timeout_s=600, members=members)
        assert client.keep_alive_timeout_s < client.timeout_s
        assert client.keep_alive(lease) == ttl
        assert members.at() == 0  # left the silent member, within the keep-alive


def test_a_refused_member_is_passed_over_within_the_request(etcd_server: EmbeddedEtcd) -> None:
    with socket.create_server((HOST, 0)) as closed:
        port = closed.getsockname()[1]
    members = Members([(HOST, port), (HOST, etcd_server.client_port)])
    client = Etcd(HOST, port, timeout_s=2, members=members)
    lease, ttl = client.grant_ttl(5)
    assert lease > 0 and ttl >= 5 and members.at() == 1


def test_every_member_unreachable_is_one_error(tmp_path: Path) -> None:
    ports = []
    for _ in range(2):
        with socket.create_server((HOST, 0)) as closed:
            ports.append(closed.getsockname()[1])
    client = Etcd(HOST, ports[0], members=Members([(HOST, p) for p in ports]))
    with pytest.raises(EtcdError):
        client.range("/members-test/")


def _params(endpoint: str, **conf: str) -> RendezvousParameters:
    return RendezvousParameters("etcd", endpoint, "run", 1, 2, **conf)


def test_the_agent_takes_its_members_from_the_rendezvous_conf() -> None:
    client = _client(_params("etcd.lab:2379", etcd_members="etcd-0.peer:2379;etcd-1.peer"))
    assert client.members.endpoints == [
        ("etcd.lab", 2379),
        ("etcd-0.peer", 2379),
        ("etcd-1.peer", 2379),
    ]
    assert client.another().members is client.members


@pytest.mark.parametrize(
    ("conf", "said"),
    [
        ({"protocol": "grpc"}, "rdzv conf protocol must be one of http, https, got 'grpc'"),
        ({"protocol": "https", "client_cert": "c.pem"}, "client_cert and client_key go together"),
        ({"protocol": "https", "ca_cert": "/nowhere/ca.pem"}, "ca_cert: /nowhere/ca.pem is not"),
        ({"etcd_members": "etcd-0:99999"}, "needs a port from 1 to 65535"),
    ],
)
def test_a_bad_rendezvous_conf_names_the_setting(conf: dict[str, str], said: str) -> None:
    with pytest.raises(ValueError, match=said):
        _client(_params("etcd.lab:2379", **conf))


def test_tls_files_without_https_are_refused(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    with pytest.raises(ValueError, match="need protocol=https"):
        _client(_params("etcd.lab:2379", ca_cert=str(ca)))


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _certificates(root: Path) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, both CA-signed."""
    files = {n: root / f"{n}.pem" for n in ("ca", "ca-key", "server", "server-key", "client")}
    files["client-key"] = root / "client-key.pem"
    _openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=lab-ca", "-days", "1",
        "-keyout", str(files["ca-key"]), "-out", str(files["ca"]),
    )  # fmt: skip
    for name, subject, extra in (
        ("server", "/CN=etcd", ["-addext", f"subjectAltName=IP:{HOST}"]),
        ("client", "/CN=agent", []),
    ):
        request = root / f"{name}.csr"
        _openssl(
            "req", "-new", "-newkey", "rsa:2048", "-nodes", "-subj", subject, *extra,
            "-keyout", str(files[f"{name}-key"]), "-out", str(request),
        )  # fmt: skip
        _openssl(
            "x509", "-req", "-in", str(request), "-CA", str(files["ca"]),
            "-CAkey", str(files["ca-key"]), "-CAcreateserial", "-days", "1", "-copy_extensions",
            "copy", "-out", str(files[name]),
        )  # fmt: skip
    return files


@pytest.mark.usefixtures("processes")
def test_https_verifies_the_members_ca_and_shows_the_client_certificate(tmp_path: Path) -> None:
    import ssl
    from http.server import BaseHTTPRequestHandler

    from tests.support.loopback import reply

    files = _certificates(tmp_path)
    seen: list[dict] = []

    class TlsGateway(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            seen.append(self.connection.getpeercert())  # type: ignore[attr-defined]
            self.rfile.read(int(self.headers["Content-Length"]))
            reply(self, 200, b'{"header": {"revision": "7"}}', {"Content-Type": "application/json"})

        def log_message(self, *args: object) -> None:
            pass

    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(files["ca"]))
    context.load_cert_chain(files["server"], files["server-key"])
    context.verify_mode = ssl.CERT_REQUIRED  # etcd's --client-cert-auth
    with loopback_server(TlsGateway, context) as url:
        endpoint = url.removeprefix("https://")
        conf = {"protocol": "https", "ca_cert": str(files["ca"])}
        client = _client(
            _params(endpoint, **conf, client_cert=str(files["client"]),
                    client_key=str(files["client-key"]))
        )  # fmt: skip
        assert client.range("/x/") == ([], 7)
        subject = dict(item for rdn in seen[0]["subject"] for item in rdn)
        assert subject["commonName"] == "agent"
        # Without the CA the member's certificate is refused: no request reaches it.
        stranger = Etcd(HOST, int(endpoint.split(":")[1]), "https", tls=Tls())
        with pytest.raises(EtcdError):
            stranger.range("/x/")
        assert len(seen) == 1


def _status(member: EmbeddedEtcd) -> dict:
    return requests.post(f"{member.client_url}/v3/maintenance/status", json={}, timeout=5).json()


def _make_leader(members: list[EmbeddedEtcd], chosen: EmbeddedEtcd) -> None:
    """Move the leadership to ``chosen`` (etcd's ``MoveLeader``, sent to the leader)."""
    target = _status(chosen)["header"]["member_id"]
    for _ in range(100):
        leader = _status(chosen)["leader"]
        if leader == target:
            return
        current = next(m for m in members if _status(m)["header"]["member_id"] == leader)
        requests.post(
            f"{current.client_url}/v3/maintenance/transfer-leadership",
            json={"targetID": target},
            timeout=10,
        )
    pytest.fail(f"{chosen.name} never became the leader")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_agents_train_on_when_their_endpoint_the_leader_freezes(tmp_path: Path, etcd: None) -> None:
    # Three members, as the cluster runs; the agents' endpoint is m0, which leads. Frozen (a VM
    # gone without a FIN), it times the agents' requests out and the other two elect a leader.
    data = tmp_path / "data"
    write_synthetic_cifar10(data, train_records=480, test_records=48, seed=1)
    args = [*TINY, "--max-steps=60", "--log-every=1", "--checkpoint-every-steps=4"]
    with etcd_members(find_etcd_binary(), tmp_path / "etcd") as members:
        m0, *others = members
        _make_leader(members, m0)
        frozen_id = _status(m0)["header"]["member_id"]
        cluster = Cluster(
            tmp_path / "run",
            m0.client_port,
            data,
            min_nodes=2,
            max_nodes=2,
            etcd_members=tuple(f"{HOST}:{m.client_port}" for m in others),
        )
        cluster.root.mkdir()
        try:
            for node in ("a", "b"):
                cluster.start(node, args)
            cluster.wait_until(lambda: cluster.steps_at(2) >= 5, 180, "step 5 at world size 2")
            os.kill(m0.pid, signal.SIGSTOP)  # type: ignore[arg-type]
            frozen_at, step = time.time(), cluster.max_step()
            cluster.wait_until(lambda: cluster.max_step() >= step + 10, 180, "10 steps more")
            for node in ("a", "b"):
                assert cluster.wait_exit(node, 180) == 0, cluster.tail()
            assert _status(others[0])["leader"] != frozen_id  # the leader changed
            logs = "".join((cluster.root / f"{n}.err").read_text() for n in ("a", "b"))
            assert f"etcd member {HOST}:{m0.client_port} left" in logs
            assert groups_at_once(cluster.records()) == []
            resumed = [e for e in cluster.events(RESUMED) if e["ts"] > frozen_at]
            assert all(e["lost_steps"] == 0 for e in resumed), resumed
            assert cluster.max_step() == 60
        finally:
            cluster.close()
