"""A threaded HTTP server on a free loopback port, for the tests' fake APIs; and the free port
itself (``free_port``: the lab's own, so the lab, the bench and the tests pick ports one way)."""

from __future__ import annotations

import socket
import ssl
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from lab.local.etcd_server import free_port

__all__ = ["free_port", "loopback_server", "reply"]


class _TlsServer(ThreadingHTTPServer):
    """Each connection's TLS handshake in its own thread: one that fails ends only itself."""

    tls: ssl.SSLContext

    def finish_request(self, request: socket.socket, client_address: tuple) -> None:  # type: ignore[override]
        try:
            request = self.tls.wrap_socket(request, server_side=True)
        except (ssl.SSLError, OSError):
            return  # a client that refused the certificate, or the reachability check
        super().finish_request(request, client_address)


@contextmanager
def loopback_server(
    handler: type[BaseHTTPRequestHandler], tls: ssl.SSLContext | None = None
) -> Iterator[str]:
    """Serve ``handler`` until the block ends (over TLS with ``tls``); yields the base URL."""
    server = (_TlsServer if tls else ThreadingHTTPServer)(("127.0.0.1", 0), handler)
    if tls is not None:
        server.tls = tls  # type: ignore[attr-defined]
    server.daemon_threads = True  # a streaming answer must not hold up the shutdown
    thread = threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    try:
        _reachable(server.server_address[1])
        scheme = "https" if tls else "http"
        yield f"{scheme}://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _reachable(port: int) -> None:
    """Fail the test with the cause when loopback is down (a fresh network namespace, as
    `unshare -n` makes, has its `lo` down): otherwise it fails as an API that cannot be reached."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except OSError as err:
        raise RuntimeError(
            f"cannot connect to the fake API on 127.0.0.1:{port} ({err.strerror}): these tests "
            "need the loopback interface up (in a new network namespace: ip link set lo up)"
        ) from None


def reply(
    handler: BaseHTTPRequestHandler, status: int, payload: bytes, headers: Mapping[str, str]
) -> None:
    """Send one whole answer; a HEAD gets the GET's headers and no body (RFC 9110, 9.3.2)."""
    handler.send_response(status)
    for name, value in headers.items():
        handler.send_header(name, value)
    handler.send_header("Content-Length", str(len(payload)))
    handler.end_headers()
    if handler.command != "HEAD":
        handler.wfile.write(payload)
