"""The container entry point: a clear error for an unusable rendezvous, else torchrun."""

from __future__ import annotations

import contextlib
import socket
import ssl
import struct
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from lab.local.etcd_server import EmbeddedEtcd, free_port
from tests.support.loopback import loopback_server, reply
from training.agent import NOT_ETCD_V3, check_rendezvous, etcd_v3_problem, main

REPO = Path(__file__).resolve().parents[2]


def _env(endpoint: str, backend: str = "etcd") -> dict[str, str]:
    return {"PET_RDZV_BACKEND": backend, "PET_RDZV_ENDPOINT": endpoint}


def test_a_healthy_etcd_passes_and_torchrun_replaces_the_process(etcd_server: EmbeddedEtcd) -> None:
    calls: list[tuple[str, list[str]]] = []
    env = {
        **_env(f"127.0.0.1:{etcd_server.client_port}"),
        "TRAIN_RDZV_WAIT_S": "0",
        "TRAIN_LAUNCHER": "torchrun",
    }
    assert (
        main(["--module", "training.train"], env=env, execv=lambda p, a: calls.append((p, a))) == 0
    )
    assert calls == [
        (
            sys.executable,
            [sys.executable, "-m", "training.plain_torchrun", "--module", "training.train"],
        )
    ]


def test_unreachable_etcd_names_the_endpoint_and_the_setting() -> None:
    waited: list[float] = []
    problem = check_rendezvous(_env(f"127.0.0.1:{free_port()}"), wait_s=0, sleep=waited.append)
    assert problem is not None
    assert "cannot reach etcd at 127.0.0.1:" in problem
    assert "PET_RDZV_ENDPOINT" in problem and "rdzvHost" in problem


def test_it_waits_for_an_etcd_that_is_still_starting() -> None:
    answers = iter(["cannot reach etcd at e:2379 (refused)", "cannot reach etcd", None])
    sleeps: list[float] = []
    assert (
        check_rendezvous(
            _env("e:2379"), wait_s=60, probe=lambda _: next(answers), sleep=sleeps.append
        )
        is None
    )
    assert sleeps == [1.0, 1.0]


def test_an_etcd_without_any_v2_flag_passes(etcd_server: EmbeddedEtcd) -> None:
    # The lab's etcd runs with the cluster's flags: no --enable-v2, which etcd 3.6 removed.
    assert etcd_v3_problem(f"127.0.0.1:{etcd_server.client_port}") is None


def test_other_backends_are_not_checked() -> None:
    assert check_rendezvous({"PET_RDZV_BACKEND": "c10d"}, wait_s=0) is None
    assert check_rendezvous({}, wait_s=0) is None


@pytest.mark.usefixtures("torchrun")
def test_an_etcd_still_unreachable_exits_138_for_a_new_pod() -> None:
    env = {**_env(f"127.0.0.1:{free_port()}"), "TRAIN_RDZV_WAIT_S": "0", "PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        [sys.executable, "-m", "training.agent", "--module", "training.train"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 138  # etcd may be back for a new pod: the operator retries
    assert "rendezvous check failed: cannot reach etcd" in result.stderr


class _NotEtcd(BaseHTTPRequestHandler):
    """Some other HTTP server on the endpoint: a 404 for the gateway's path."""

    def do_POST(self) -> None:
        reply(self, 404, b"404 page not found", {"Content-Type": "text/plain"})

    def log_message(self, *args: object) -> None:
        pass


class _HtmlServer(_NotEtcd):
    def do_POST(self) -> None:
        reply(self, 200, b"<html>hello</html>", {"Content-Type": "text/html"})


class _TlsEtcd(_NotEtcd):
    """A TLS etcd reached over plain HTTP: Go's net/http answers this 400 (``server.go``,
    "Client sent an HTTP request to an HTTPS server.")."""

    def do_POST(self) -> None:
        reply(self, 400, b"Client sent an HTTP request to an HTTPS server.\n", {})


@pytest.mark.parametrize(
    ("handler", "said"),
    [
        (_NotEtcd, "HTTP 404): not etcd, or an etcd older than 3.4"),
        (_HtmlServer, "did not answer JSON"),
        (_TlsEtcd, "it wants TLS"),
    ],
)
def test_an_endpoint_that_is_not_etcds_v3_api_is_said_in_one_line_and_not_waited_for(
    handler: type[BaseHTTPRequestHandler], said: str
) -> None:
    sleeps: list[float] = []
    with loopback_server(handler) as url:
        endpoint = url.removeprefix("http://")
        problem = check_rendezvous(_env(endpoint), wait_s=60, sleep=sleeps.append)
    assert problem is not None and "\n" not in problem
    assert endpoint in problem and NOT_ETCD_V3 in problem and said in problem
    assert sleeps == []  # no wait fixes it: the agent exits 2 at once


@pytest.mark.usefixtures("processes")
def test_a_tls_port_that_hangs_up_on_plain_http_is_named(tmp_path: Path) -> None:
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=localhost"]
        + ["-keyout", str(key), "-out", str(cert), "-days", "1"],
        check=True,
        capture_output=True,
        timeout=60,
    )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)

    def serve() -> None:  # a TLS server: the plain request fails its handshake
        conn, _ = listener.accept()
        with contextlib.suppress(OSError, ssl.SSLError):
            context.wrap_socket(conn, server_side=True)
        conn.close()

    threading.Thread(target=serve, daemon=True).start()
    endpoint = f"127.0.0.1:{listener.getsockname()[1]}"
    try:
        problem = etcd_v3_problem(endpoint, timeout_s=30)  # a loaded machine: time to hang up
    finally:
        listener.close()
    assert problem is not None and endpoint in problem and "it wants TLS" in problem


def _agent(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "training.agent", *args],
        cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "TRAIN_RDZV_WAIT_S": "0", **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.usefixtures("torchrun")
def test_an_unknown_launcher_names_the_setting_and_the_choices() -> None:
    result = _agent(["--module", "training.train"], {"TRAIN_LAUNCHER": "fast"})
    assert result.returncode == 2
    assert "TRAIN_LAUNCHER must be one of warm, torchrun, got 'fast'" in result.stderr


def test_the_warm_launcher_runs_the_training_module_only(etcd_server: EmbeddedEtcd) -> None:
    env = {**_env(f"127.0.0.1:{etcd_server.client_port}"), "TRAIN_LAUNCHER": "warm"}
    result = _agent(["--nnodes=1", "--module", "other.module"], env)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "runs --module training.train only, got 'other.module'" in result.stderr
    assert "TRAIN_LAUNCHER=torchrun" in result.stderr


def test_the_warm_launcher_refuses_bad_training_flags_before_it_joins(
    etcd_server: EmbeddedEtcd,
) -> None:
    env = {**_env(f"127.0.0.1:{etcd_server.client_port}"), "TRAIN_LAUNCHER": "warm"}
    args = ["--nnodes=1", "--module", "training.train", "--data-dir", "/d", "--max-steps", "ten"]
    result = _agent([*args, "--checkpoint-uri", "/c"], env)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "--max-steps must be int, got 'ten'" in result.stderr
    assert "rendezvous" not in result.stderr.lower().replace("rendezvous check", "")


def test_a_port_that_resets_the_request_is_named_not_taken_for_an_etcd_still_starting() -> None:
    # What a TLS server did to the plain request on a loaded machine: accept, then RST. A
    # refused connection is an etcd not up yet; a reset one is a server that will not talk.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)

    def reset() -> None:
        conn, _ = listener.accept()
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()  # linger 0: an RST instead of a FIN

    threading.Thread(target=reset, daemon=True).start()
    endpoint = f"127.0.0.1:{listener.getsockname()[1]}"
    try:
        problem = etcd_v3_problem(endpoint, timeout_s=30)
    finally:
        listener.close()
    assert problem is not None and NOT_ETCD_V3 in problem and "reset" in problem.lower()
