"""A threaded HTTP server on a free loopback port, for the tests' fake APIs; and the free port
itself (``free_port``: the lab's own, so the lab, the bench and the tests pick ports one way)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from lab.local.etcd_server import free_port

__all__ = ["free_port", "loopback_server", "reply"]


@contextmanager
def loopback_server(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """Serve ``handler`` until the block ends; yields the server's base URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True  # a streaming answer must not hold up the shutdown
    thread = threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    try:
        _reachable(server.server_address[1])
        yield f"http://127.0.0.1:{server.server_address[1]}"
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
