"""A watch stream that etcd's gateway answers with an error line is an error, and is reopened
with backoff.

The gateway reports a stream that failed in-band: HTTP 200, then a line
``{"error": {"grpc_code": 14, ...}}`` (grpc-gateway's ``runtime/handler.go``, the stream's
error chunk; its issue #519 shows the shape). A watcher that skips the line sees a stream that
ended cleanly and reopens it at once: one agent opened 24 streams a second, and never noted
etcd as away. Here a loopback proxy in front of the real etcd answers every watch that way and
counts the reopens.
"""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator

import pytest
import requests

from lab.local.etcd_server import EmbeddedEtcd
from tests.support.waiting import wait_until
from training.elastic.etcd_v3 import Backoff, Etcd, EtcdError
from training.elastic.liveness import Progress
from training.elastic.membership import Membership
from training.elastic.rounds import Timing

ERROR_LINE = (
    b'{"error":{"grpc_code":14,"http_code":503,"message":"etcdserver: no leader",'
    b'"http_status":"Service Unavailable"}}\n'
)


class ErrorGateway(http.server.ThreadingHTTPServer):
    """Forwards every request to etcd but ``/v3/watch``, which it answers with the error line
    (and counts, with the time of each)."""

    def __init__(self, etcd_port: int) -> None:
        self.etcd_port = etcd_port
        self.watches: list[float] = []
        super().__init__(("127.0.0.1", 0), _Handler)
        self.daemon_threads = True
        threading.Thread(target=self.serve_forever, daemon=True).start()


class _Handler(http.server.BaseHTTPRequestHandler):
    server: ErrorGateway

    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.path == "/v3/watch":
            self.server.watches.append(time.monotonic())
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(ERROR_LINE)))
            self.end_headers()
            self.wfile.write(ERROR_LINE)
            return
        answer = requests.post(f"http://127.0.0.1:{self.server.etcd_port}{self.path}", data=body)
        self.send_response(answer.status_code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer.content)))
        self.end_headers()
        self.wfile.write(answer.content)


@pytest.fixture
def gateway(etcd_server: EmbeddedEtcd) -> Iterator[ErrorGateway]:
    server = ErrorGateway(etcd_server.client_port)
    yield server
    server.shutdown()


def test_an_error_line_ends_the_watch_with_an_error(gateway: ErrorGateway) -> None:
    client = Etcd("127.0.0.1", gateway.server_address[1])
    with pytest.raises(EtcdError, match="grpc_code 14"):
        list(client.watch("/spot-lab/x/", 0, idle_s=5))


def test_a_watch_answered_with_an_error_line_is_reopened_with_backoff(
    gateway: ErrorGateway,
) -> None:
    client = Etcd("127.0.0.1", gateway.server_address[1])
    keys = Membership(
        client,
        client.another(),
        f"run-{time.monotonic_ns()}",
        "a",
        "127.0.0.1",
        Timing(keep_alive_interval_s=1, keep_alive_max_attempt=5),
        Progress(60),
    )
    # Each failed stream is noted as etcd away. The flag itself is no witness: the heartbeat's
    # keep-alives, which the gateway forwards, clear it between two streams.
    noted, note_down = [], keys.note_down

    def noting(exc: BaseException) -> float:
        noted.append(threading.current_thread().name)
        return note_down(exc)

    keys.note_down = noting  # type: ignore[method-assign]
    keys.start()
    try:
        wait_until(lambda: len(gateway.watches) >= 6, 30, "six watch streams opened")
        wait_until(lambda: noted.count("rdzv-watch") >= 5, 30, "the failed streams noted")
    finally:
        keys.leave()
    gaps = [b - a for a, b in zip(gateway.watches, gateway.watches[1:6], strict=False)]
    # The backoff's lower bounds: 0.25 s, then half of 0.5, 1, 2 and 4 s (its jitter).
    floors = [Backoff.FIRST_S, 0.25, 0.5, 1.0, 2.0]
    assert all(gap >= 0.9 * floor for gap, floor in zip(gaps, floors, strict=True)), gaps


def test_the_backoff_doubles_with_jitter_from_a_quarter_second_to_five() -> None:
    backoff = Backoff()
    delays = [backoff.next() for _ in range(10)]
    assert all(Backoff.FIRST_S <= d <= Backoff.CAP_S for d in delays), delays
    assert delays[-1] >= Backoff.CAP_S / 2
    backoff.reset()
    assert backoff.next() <= 2 * Backoff.FIRST_S
