"""etcd's v3 API, as the rendezvous uses it: ranges with their revision, transactions that
compare a key's revision, leases, and a watch from a known revision.

Through etcd3gw (docs/pins.md): its ``Etcd3Client`` speaks etcd's gRPC-JSON gateway over
HTTP (``/v3/kv/range``, ``/v3/kv/txn``, ``/v3/lease/grant``, ``/v3/lease/keepalive``,
``/v3/watch``; etcd's "gRPC gateway" page and ``api/etcdserverpb/rpc.proto``), one
``requests`` session per client. Its ``get`` drops the response header (the store's revision
a watch must start after) and its ``watch`` has no read timeout (a vanished etcd would hold
the watch for good), so those two are posted to the same endpoints here through the client's
own ``post`` and session. Keys and values are base64 in the gateway's JSON (proto ``bytes``).

A stream that fails is reported in-band: HTTP 200, then one line ``{"error": {"grpc_code": ..,
"message": ..}}`` (grpc-gateway's ``runtime/handler.go`` writes a stream's error as that chunk;
its issue #519 shows the shape). ``watch`` raises it as an EtcdError, and every watcher reopens
only after a ``Backoff``: a watcher that took the line for a clean end reopened at once, 24
streams a second for one agent.

**Members.** A client knows every member it may use (``Members``, shared by the clients of one
agent) and leaves one that cannot serve it. Every request carries etcd's require-leader
metadata (``Grpc-Metadata-hasleader: true``: grpc-gateway's ``DefaultHeaderMatcher`` passes a
``Grpc-Metadata-`` header on as gRPC metadata; etcd's ``api/v3rpc/rpctypes/metadatafields.go``
names the key, and ``server/etcdserver/api/v3rpc/interceptor.go`` refuses a unary request at
once with ``etcdserver: no leader`` on a member without a leader, and cancels its watches). Without
it, a member cut off from the quorum holds a read 7 s (its request timeout) and a watch stays
open and silent; with it, the answer is immediate (tests/training/elastic/test_members.py, on
a real three-member etcd). A refusal, a connection refused and "no leader" were not applied, so
the request goes on to the next member at once; a write that timed out may have been applied, so it
fails (its caller retries) and the next request goes to the next member, while a read or a
keep-alive goes on at once: a member cut off from the quorum is left within one request timeout
(a keep-alive's own, ``KEEP_ALIVE_TIMEOUT_S``, for a keep-alive).
"""

from __future__ import annotations

import base64
import json
import logging
import random
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import requests
from etcd3gw.client import Etcd3Client
from etcd3gw.exceptions import ConnectionFailedError, ConnectionTimeoutError, Etcd3Exception

__all__ = ["Backoff", "Etcd", "EtcdError", "Event", "KeyValue", "Members", "Tls", "WatchCompacted"]

logger = logging.getLogger(__name__)

REQUIRE_LEADER = {"Grpc-Metadata-hasleader": "true"}
"""etcd's require-leader metadata through the gateway (the module docstring)."""
NO_LEADER = "etcdserver: no leader"
KEEP_ALIVE_TIMEOUT_S = 0.5
"""How long a keep-alive waits for its member before going on to the next: a renewal is answered
in milliseconds (no disk write), so a member that takes longer is frozen or without a leader,
and the next member must still be asked well inside the fence's window (the lease's TTL less
its margin: training/elastic/membership.py)."""

EtcdError = Etcd3Exception
"""Every failure of a request: unreachable, timed out, or an error answer."""


class WatchCompacted(Etcd3Exception):
    """The watch's start revision was compacted away: read again, then watch on."""


class Backoff:
    """The wait before a failed watch (or request) is tried again: doubling from ``FIRST_S`` up
    to ``CAP_S``, each wait drawn from its upper half (jitter: N agents that lost etcd at one
    moment do not come back in one burst); ``reset`` after a success."""

    FIRST_S = 0.25
    CAP_S = 5.0

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()
        self.failures = 0

    def next(self) -> float:
        base = min(self.CAP_S, self.FIRST_S * 2**self.failures)
        self.failures = min(self.failures + 1, 16)
        return max(self.FIRST_S, base * (0.5 + self._rng.random() / 2))

    def reset(self) -> None:
        self.failures = 0


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _unb64(text: str | None) -> str:
    return base64.b64decode(text or "").decode()


def prefix_end(prefix: str) -> str:
    """The range end that covers every key under ``prefix`` (etcd's ``WithPrefix``)."""
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


@dataclass(frozen=True)
class KeyValue:
    key: str
    value: str
    create_revision: int
    mod_revision: int
    lease: int


def _kv(raw: dict[str, Any]) -> KeyValue:
    return KeyValue(
        key=_unb64(raw.get("key")),
        value=_unb64(raw.get("value")),
        create_revision=int(raw.get("create_revision", 0)),
        mod_revision=int(raw.get("mod_revision", 0)),
        lease=int(raw.get("lease", 0)),
    )


@dataclass(frozen=True)
class Event:
    """One change a watch reported: a put of ``kv``, or its deletion (an expired lease's
    included); a deletion's ``kv`` has only the key and the revision of the deletion."""

    kv: KeyValue
    deleted: bool


def put(key: str, value: str, lease: int = 0) -> dict[str, Any]:
    """A put operation of a transaction."""
    request: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
    if lease:
        request["lease"] = lease
    return {"request_put": request}


def delete(key: str, prefix: bool = False) -> dict[str, Any]:
    """A delete operation of a transaction (of every key under ``key`` with ``prefix``)."""
    request = {"key": _b64(key)}
    if prefix:
        request["range_end"] = _b64(prefix_end(key))
    return {"request_delete_range": request}


def mod_revision_is(key: str, revision: int) -> dict[str, Any]:
    """The compare 'the key was last written at ``revision``' (0: the key is absent)."""
    return {"key": _b64(key), "result": "EQUAL", "target": "MOD", "mod_revision": revision}


def absent(key: str) -> dict[str, Any]:
    """The compare 'the key does not exist' (its create revision is 0)."""
    return {"key": _b64(key), "result": "EQUAL", "target": "CREATE", "create_revision": 0}


def value_is(key: str, value: str) -> dict[str, Any]:
    return {"key": _b64(key), "result": "EQUAL", "target": "VALUE", "value": _b64(value)}


@dataclass(frozen=True)
class Tls:
    """How a client reaches an etcd that serves TLS (``protocol=https``): the CA that signed
    the members' certificates (None: the system's), and a client certificate and its key for a
    member that asks for one (etcd's ``--client-cert-auth``)."""

    ca_cert: str | None = None
    client_cert: str | None = None
    client_key: str | None = None

    def validate(self) -> None:
        if (self.client_cert is None) != (self.client_key is None):
            raise ValueError(
                "rdzv conf client_cert and client_key go together: give both files or neither"
            )


class Members:
    """The etcd members an agent's clients may use, and the one they use now: a client that
    leaves a member moves every client of the agent on (``Etcd.another`` shares this)."""

    def __init__(self, endpoints: Sequence[tuple[str, int]]) -> None:
        if not endpoints:
            raise ValueError("etcd needs at least one endpoint (host:port)")
        self.endpoints = list(dict.fromkeys(endpoints))
        self._at = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.endpoints)

    def at(self) -> int:
        """The index of the member in use."""
        with self._lock:
            return self._at

    def leave(self, index: int, why: str) -> None:
        """Go on from member ``index`` to the next, unless another client already did."""
        with self._lock:
            if self._at != index or len(self.endpoints) == 1:
                return
            self._at = (index + 1) % len(self.endpoints)
            gone, now = self.endpoints[index], self.endpoints[self._at]
        logger.warning("etcd member %s:%d left (%s); now %s:%d", *gone, why, *now)


def _said(error: Etcd3Exception) -> str:
    """What the error says: etcd3gw keeps an answer's body apart from its args."""
    return " ".join(str(part) for part in (error.detail_text, *error.args) if part)


def _no_leader(error: Etcd3Exception) -> bool:
    return NO_LEADER in _said(error)


def _why_leave(error: Etcd3Exception) -> tuple[str, bool] | None:
    """Why to leave the member that raised ``error``, and whether the request may go to the
    next one (it was not applied); None: the member served it, and the error is the answer."""
    if _no_leader(error):
        return "no leader", True
    # etcd3gw maps 503 (etcd's "request timed out" among others) to ConnectionFailedError: a
    # proposal that timed out may still apply.
    if isinstance(error, ConnectionTimeoutError) or "timed out" in _said(error):
        return "timed out", False
    if isinstance(error, ConnectionFailedError):
        return "unreachable", True
    return None


class Etcd:
    """A connection to etcd's v3 gateway: at ``host:port``, or at one of ``members``."""

    def __init__(
        self,
        host: str,
        port: int,
        protocol: str = "http",
        timeout_s: float = 2.0,
        *,
        members: Members | None = None,
        tls: Tls = Tls(),
    ) -> None:
        self.members = members or Members([(host, port)])
        self.timeout_s = timeout_s
        self.keep_alive_timeout_s = min(timeout_s, KEEP_ALIVE_TIMEOUT_S)
        self._protocol, self._tls = protocol, tls
        session = requests.Session()
        session.headers.update(REQUIRE_LEADER)
        # Per request, not on the session: requests lets REQUESTS_CA_BUNDLE override a
        # session's ``verify`` (psf/requests#3829), and many images set it.
        self._tls_args: dict[str, Any] = {}
        if tls.ca_cert is not None:
            self._tls_args["verify"] = tls.ca_cert
        if tls.client_cert is not None and tls.client_key is not None:
            self._tls_args["cert"] = (tls.client_cert, tls.client_key)

        # The API path is fixed: /v3/ is served by every etcd from 3.4 on, and etcd3gw's
        # discovery would cost a /version request on the first call. One session for every
        # member: one thread's client, its connections pooled per member.
        def each_member(timeout: float) -> list[Etcd3Client]:
            return [
                Etcd3Client(h, p, protocol, timeout=timeout, api_path="/v3/", session=session)
                for h, p in self.members.endpoints
            ]

        self._clients = each_member(timeout_s)
        self._keep_alive_clients = each_member(self.keep_alive_timeout_s)

    @property
    def client(self) -> Etcd3Client:
        """etcd3gw's client of the member in use."""
        return self._clients[self.members.at()]

    @property
    def endpoint(self) -> str:
        host, port = self.members.endpoints[self.members.at()]
        return f"{host}:{port}"

    def another(self) -> Etcd:
        """A client of its own to the same members, for another thread (a ``requests``
        session is not shared across threads); it moves on from a member with this one."""
        host, port = self.members.endpoints[0]
        return Etcd(host, port, self._protocol, self.timeout_s, members=self.members, tls=self._tls)

    def _post(self, path: str, body: dict[str, Any], read: bool = False) -> dict[str, Any]:
        return self._send(path, read, json=body)

    def _send(
        self,
        path: str,
        read: bool = False,
        clients: Sequence[Etcd3Client] | None = None,
        **payload: Any,
    ) -> dict[str, Any]:
        """POST to the member in use; on to the next when it did not take the request (the
        module docstring), each member once. A ``read`` (or a keep-alive) changes nothing
        when applied twice, so it goes on after a timeout too. ``clients``: the members'
        clients to send with (their timeout), the general ones by default."""
        clients = clients or self._clients
        start = self.members.at()
        for tried in range(len(self.members)):
            index = (start + tried) % len(self.members)
            client = clients[index]
            try:
                return client.post(client.get_url(path), **payload, **self._tls_args)
            except Etcd3Exception as error:
                if (leave := _why_leave(error)) is None:
                    raise
                self.members.leave(index, leave[0])
                if not (leave[1] or read):
                    raise
                failure = error
        raise failure

    # -- keys ----------------------------------------------------------------------------------
    def range(
        self, prefix: str, end: str | None = None, first: int = 0
    ) -> tuple[list[KeyValue], int]:
        """Every key under ``prefix`` (from ``prefix`` up to ``end`` when given), and the
        store's revision when they were read; ``first``: only that many, the oldest created
        (``RangeRequest``'s ``limit`` with ``sort_target`` CREATE)."""
        body: dict[str, Any] = {"key": _b64(prefix), "range_end": _b64(end or prefix_end(prefix))}
        if first:
            body.update(limit=first, sort_order="ASCEND", sort_target="CREATE")
        answer = self._post("/kv/range", body, read=True)
        return [_kv(kv) for kv in answer.get("kvs", [])], int(answer["header"]["revision"])

    def get(self, key: str) -> KeyValue | None:
        answer = self._post("/kv/range", {"key": _b64(key)}, read=True)
        kvs = answer.get("kvs", [])
        return _kv(kvs[0]) if kvs else None

    def txn(
        self,
        compare: list[dict[str, Any]],
        success: list[dict[str, Any]],
        failure: list[dict[str, Any]] | None = None,
    ) -> tuple[bool, int]:
        """One transaction (etcd's ``Txn``): whether ``compare`` held, and the revision."""
        body = {"compare": compare, "success": success, "failure": failure or []}
        answer = self._send("/kv/txn", data=json.dumps(body))
        return bool(answer.get("succeeded", False)), int(answer["header"]["revision"])

    def txn_or_read(
        self, compare: list[dict[str, Any]], success: list[dict[str, Any]], keys: list[str]
    ) -> tuple[bool, int, list[KeyValue]]:
        """``txn``, which reads ``keys`` when ``compare`` fails (its failure branch): whether
        it held, the revision, and on a failure the keys as they are (those that exist)."""
        failure = [{"request_range": {"key": _b64(key)}} for key in keys]
        body = {"compare": compare, "success": success, "failure": failure}
        answer = self._send("/kv/txn", data=json.dumps(body))
        done, revision = bool(answer.get("succeeded", False)), int(answer["header"]["revision"])
        if done:
            return True, revision, []
        ranges = [r.get("response_range", {}) for r in answer.get("responses", [])]
        return False, revision, [_kv(kv) for r in ranges for kv in r.get("kvs", [])]

    def delete(self, key: str, prefix: bool = False) -> None:
        body = {"key": _b64(key)}
        if prefix:
            body["range_end"] = _b64(prefix_end(key))
        self._post("/kv/deleterange", body)

    # -- leases --------------------------------------------------------------------------------
    def grant(self, ttl_s: int) -> int:
        """A new lease of ``ttl_s`` seconds; its id."""
        return self.grant_ttl(ttl_s)[0]

    def grant_ttl(self, ttl_s: int) -> tuple[int, int]:
        """A new lease asking for ``ttl_s`` seconds: its id and the TTL etcd granted (never
        less than its minimum, 1.5 election timeouts rounded up: 2 s at the defaults,
        ``server/etcdserver/server.go``, ``minTTL``)."""
        answer = self._post("/lease/grant", {"TTL": int(ttl_s), "ID": 0})
        return int(answer["ID"]), int(answer.get("TTL", ttl_s))

    def keep_alive(self, lease: int) -> int:
        """Renew ``lease``; its new TTL, or -1 when it has expired (etcd answers no TTL)."""
        answer = self._send(
            "/lease/keepalive", read=True, clients=self._keep_alive_clients, json={"ID": lease}
        )
        return int(answer.get("result", {}).get("TTL", -1))

    def time_to_live(self, lease: int) -> int:
        """Seconds left on ``lease`` (-1: expired or unknown)."""
        return int(self._post("/kv/lease/timetolive", {"ID": lease}, read=True).get("TTL", -1))

    def revoke(self, lease: int) -> None:
        self._post("/lease/revoke", {"ID": lease})

    # -- the watch -----------------------------------------------------------------------------
    def watch(
        self,
        prefix: str,
        after: int,
        idle_s: float,
        end: str | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> Iterator[list[Event]]:
        """Every change under ``prefix`` (up to ``end`` when given) after revision ``after``,
        one list per watch response,
        in revision order, on one stream; the stream ends once ``idle_s`` pass without a
        response, and the caller watches again from the last revision it saw.

        ``start_revision = after + 1`` (etcd's ``WatchCreateRequest``) replays every change
        since, so nothing between the caller's read and the watch is missed; the events carry
        the keys' new values, so a watcher keeps its copy current without reading the keys
        again. WatchCompacted when that history is gone. The gateway leaves a PUT's ``type``
        out of its JSON (the proto's default, 0), and sends a DELETE's as ``"DELETE"``.

        The stream asks for ``progress_notify``: etcd then sends, on a quiet stream, a response
        with no events whose header revision every later event exceeds (``rpc.proto``,
        ``WatchCreateRequest``, ``ResponseHeader.revision``); ``progress`` is told it, so a
        watcher that reopens starts from there. An error line is an EtcdError.
        """
        body = {
            "create_request": {
                "key": _b64(prefix),
                "range_end": _b64(end or prefix_end(prefix)),
                "start_revision": after + 1,
                "progress_notify": True,
            }
        }
        index = self.members.at()
        try:
            yield from self._watch(index, body, idle_s, progress)
        except EtcdError as error:
            # Not a compaction or a cancel: the member could not serve the watch. The
            # watcher's next stream (after its backoff) goes to the next one.
            if _no_leader(error):
                self.members.leave(index, "no leader")
            elif isinstance(error.__cause__, requests.RequestException):
                self.members.leave(index, "watch failed")
            raise

    def _watch(
        self,
        index: int,
        body: dict[str, Any],
        idle_s: float,
        progress: Callable[[int], None] | None,
    ) -> Iterator[list[Event]]:
        client = self._clients[index]
        try:
            response = client.session.post(
                client.get_url("/watch"),
                json=body,
                stream=True,
                timeout=(self.timeout_s, idle_s),
                **self._tls_args,
            )
        except requests.exceptions.RequestException as exc:
            raise EtcdError(str(exc)) from exc
        with response:
            if response.status_code != 200:
                said = f"watch answered {response.status_code}: {response.text.strip()}"
                raise EtcdError(response.text, said)
            try:
                for line in response.iter_lines():
                    if not line.strip():
                        continue
                    answer = json.loads(line)
                    if "error" in answer:  # the gateway's in-band report of a failed stream
                        error = answer["error"] or {}
                        said = f"watch stream error: grpc_code {error.get('grpc_code')} "
                        said += str(error.get("message", ""))
                        raise EtcdError(said, said)
                    result = answer.get("result", {})
                    if int(result.get("compact_revision", 0)):
                        raise WatchCompacted(f"compacted at {result['compact_revision']}")
                    if result.get("canceled"):
                        raise EtcdError(f"watch canceled: {result.get('cancel_reason', '')}")
                    events = result.get("events")
                    if events:
                        yield [Event(_kv(e["kv"]), e.get("type") == "DELETE") for e in events]
                    elif progress is not None and not result.get("created"):
                        progress(int(result.get("header", {}).get("revision", 0)))
            except requests.exceptions.ConnectionError as exc:
                # The read timed out (urllib3 reports it as a connection error in a stream):
                # nothing changed for idle_s; or etcd went away, which the next call tells.
                if "timed out" in str(exc).lower():
                    return
                raise EtcdError(str(exc)) from exc
            except requests.exceptions.RequestException as exc:
                raise EtcdError(str(exc)) from exc

    def wait(self, prefix: str, after: int, timeout_s: float) -> int:
        """Block until a key under ``prefix`` changes after revision ``after``, or
        ``timeout_s`` passes; the revision of the change (``after`` on a timeout). The first
        response of a ``watch`` (so a change between the caller's read and this call is never
        missed); WatchCompacted when that history is gone."""
        for events in self.watch(prefix, after, idle_s=timeout_s):
            return max(event.kv.mod_revision for event in events)
        return after
