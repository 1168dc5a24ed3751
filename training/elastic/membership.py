"""One node's membership in the run's etcd directory: the keys, their reads and writes, this
node's heartbeat key and probe port, and the watch that keeps a view of the directory current.

Layout under ``/spot-lab/rendezvous/<run_id>/`` (etcd v2 API):
- ``state``: JSON with the round, its members (null while the round is open), the previous
  round's members, the bootstrap address of the round's rank 0, and ``closed``. Written only by
  compare-and-swap on its index.
- ``nodes/<id>``: one per live agent: its address, its probe port and ``left``. A TTL that the
  agent refreshes while its own loop makes progress.
- ``join/<round>/<id>``: written once by each node that joins an open round, with the address
  and a free port its workers' store would use were it rank 0; withdrawn when the node leaves.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import etcd

from training.elastic.liveness import ProbeServer, Progress
from training.elastic.rounds import Timing, View

logger = logging.getLogger(__name__)

ROOT = "/spot-lab"


def parse_view(result: etcd.EtcdResult, root: str) -> View:
    """The run directory's keys (one recursive GET) as a View."""
    view = View(etcd_index=int(result.etcd_index or 0), read_at=time.monotonic())
    joins: list[tuple[int, int, str, dict[str, Any]]] = []
    for leaf in result.leaves:
        rel = leaf.key[len(root) :].strip("/").split("/")
        if rel == ["state"] and leaf.value:
            view.state, view.state_index = json.loads(leaf.value), leaf.modifiedIndex
        elif len(rel) == 2 and rel[0] == "nodes" and leaf.value:
            view.nodes[rel[1]] = json.loads(leaf.value)
        elif len(rel) == 3 and rel[0] == "join":
            joins.append((int(rel[1]), leaf.createdIndex, rel[2], json.loads(leaf.value or "{}")))
    for round_, _, node, info in sorted(joins, key=lambda j: j[:2]):
        view.joined.setdefault(round_, {})[node] = info
    return view


def parse_endpoint(endpoint: str, default_port: int) -> tuple[str, int]:
    """``host``, ``host:port``, ``[v6]`` or ``[v6]:port`` as (host, port) (torchrun's
    ``--rdzv-endpoint``, the operator's PET_RDZV_ENDPOINT); ValueError naming the value."""
    text = endpoint.strip()
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest.removeprefix(":") if rest.startswith(":") else rest or None
    elif text.count(":") == 1:
        host, port = text.split(":")
    else:
        host, port = text, None  # a name, an IPv4 address, or a bare IPv6 address
    if not host:
        raise ValueError(f"PET_RDZV_ENDPOINT {endpoint!r} names no host (host:port)")
    if port is None:
        return host, default_port
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"PET_RDZV_ENDPOINT {endpoint!r} needs a port from 1 to 65535")
    return host, int(port)


class Membership:
    """This node's keys in one run's directory, and the view of the others'."""

    def __init__(
        self,
        client: etcd.Client,
        watch_client: etcd.Client,
        run_id: str,
        node: str,
        addr: str,
        timing: Timing,
        progress: Progress,
        saw: Callable[[dict[str, dict[str, Any]]], None] = lambda nodes: None,
    ) -> None:
        self.client, self._watch_client = client, watch_client
        self._saw = saw
        """Told every registered node read, so that a key that expired is still probed where
        it was (training/elastic/liveness.py, ``Detector``)."""
        self.node, self.addr, self.timing, self.progress = node, addr, timing, progress
        self.root = f"{ROOT}/rendezvous/{run_id}"
        self.store_dir = f"{ROOT}/store/{run_id}"
        self.probe: ProbeServer | None = None
        self.stop = threading.Event()
        self.view = View()
        self._changed = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._written_index = 0
        self.etcd_down_since: float | None = None
        self.joined_round = 0
        self._port_held: socket.socket | None = None
        """Reserves the port published in this node's join key until the round completes."""

    # -- reads ------------------------------------------------------------------------------
    def read_state(self) -> tuple[dict[str, Any] | None, int]:
        try:
            result = self.client.read(f"{self.root}/state")
        except etcd.EtcdKeyNotFound:
            return None, 0
        return json.loads(result.value), result.modifiedIndex

    def read_view(self) -> View:
        try:
            result = self.client.read(self.root, recursive=True)
        except etcd.EtcdKeyNotFound:
            return View(read_at=time.monotonic())
        view = parse_view(result, self.root)
        self._saw(view.nodes)
        return view

    def current_view(self) -> View:
        """The watched view, or a fresh read when it may predate this node's last write."""
        view = self.view
        if view.etcd_index < self._written_index or not view.read_at:
            view = self.read_view()
            self._keep(view)
        return view

    def _keep(self, view: View) -> None:
        if view.etcd_index >= self.view.etcd_index:
            self.view = view

    # -- writes -----------------------------------------------------------------------------
    def _write(self, key: str, value: str | None, **kwargs: Any) -> etcd.EtcdResult:
        result = self.client.write(key, value, **kwargs)
        self._written_index = max(self._written_index, int(result.modifiedIndex or 0))
        return result

    def write_state(self, state: dict[str, Any], index: int | None) -> bool:
        """Compare-and-swap against ``index`` (None: create only if absent)."""
        cond: dict[str, Any] = {"prevExist": False} if index is None else {"prevIndex": index}
        try:
            self._write(f"{self.root}/state", json.dumps(state), **cond)
        except (etcd.EtcdCompareFailed, etcd.EtcdKeyNotFound, etcd.EtcdAlreadyExist):
            self._written_index = self.view.etcd_index + 1  # read again before acting
            return False
        return True

    def update_state(self, change: Any, round_: int) -> None:
        while True:
            state, index = self.read_state()
            base = state or {"round": round_, "members": None, "previous": []}
            if self.write_state(change(base), None if state is None else index):
                return

    def join(self, round_: int) -> None:
        """Join ``round_``, publishing where this node's workers' store would listen."""
        if self._port_held is None:
            self._port_held = socket.socket()
            self._port_held.bind(("", 0))
        info = {"addr": self.addr, "port": self._port_held.getsockname()[1]}
        key = f"{self.root}/join/{round_}/{self.node}"
        with contextlib.suppress(etcd.EtcdAlreadyExist):
            self._write(key, json.dumps(info), prevExist=False, ttl=self.timing.join_timeout_s)
        self.joined_round = round_

    def release_port(self) -> None:
        """The round is this node's: its workers may bind the published port now."""
        if self._port_held is not None:
            self._port_held.close()
            self._port_held = None

    def forget_rounds_before(self, round_: int, view: View) -> None:
        """Old rounds' join keys: every watch re-reads the directory, keep it to one round."""
        for old in (r for r in view.joined if r < round_):
            with contextlib.suppress(etcd.EtcdException):
                self.client.delete(f"{self.root}/join/{old}", recursive=True, dir=True)

    # -- etcd away ---------------------------------------------------------------------------
    def note_down(self, exc: BaseException) -> float:
        """How long etcd has been unreachable, saying so once."""
        if self.etcd_down_since is None:
            self.etcd_down_since = time.monotonic()
            logger.warning("etcd unreachable (%s); retrying, the group trains on", exc)
        return time.monotonic() - self.etcd_down_since

    def note_up(self) -> None:
        if self.etcd_down_since is not None:
            logger.info(
                "etcd reachable again after %.1f s", time.monotonic() - self.etcd_down_since
            )
            self.etcd_down_since = None

    # -- this node's key, its probe port, and the watch ---------------------------------------
    def _node_info(self, left: bool = False) -> str:
        assert self.probe is not None
        return json.dumps({"addr": self.addr, "port": self.probe.port, "left": left})

    def start(self) -> None:
        """Listen for probes, register, start the heartbeat and the watch (once)."""
        if self._threads:
            return
        if self.probe is None:
            self.probe = ProbeServer(self.node, self.progress)
        # torch's EtcdStore.get watches from index 0 when the store's directory is missing:
        # a rank that reads between rank 0's two writes would wait out the store's timeout.
        with contextlib.suppress(etcd.EtcdAlreadyExist, etcd.EtcdNotFile):
            self.client.write(self.store_dir, None, dir=True, prevExist=False)
        self.beat()  # may raise: the caller retries while etcd is away
        for target, name in ((self._heartbeats, "rdzv-heartbeat"), (self._watch, "rdzv-watch")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def beat(self) -> None:
        """Renew this node's key, while its agent's loop makes progress and it has not left.

        etcd v2 API, "Refreshing key TTL": refresh=true renews the TTL without notifying
        watchers (python-etcd's Client.refresh), so heartbeats wake nobody's watch. Both writes
        are conditional: a heartbeat in flight when ``leave()`` wrote ``left`` (a refresh that
        would cut its TTL, a re-registration that would undo it) is refused by etcd.
        """
        if self.progress.stalled():
            return  # a wedged agent: its key expires, as a frozen node's does
        key, registered = f"{self.root}/nodes/{self.node}", self._node_info()
        try:
            self.client.refresh(key, ttl=self.timing.ttl_s, prevValue=registered)
        except etcd.EtcdCompareFailed:
            return  # left: leave() rewrote the key
        except etcd.EtcdKeyNotFound:
            # First beat, or the key expired while etcd was away: the probe kept us alive.
            with contextlib.suppress(etcd.EtcdAlreadyExist):
                self._write(key, registered, ttl=self.timing.ttl_s, prevExist=False)

    def _heartbeats(self) -> None:
        while not self.stop.wait(self.timing.keep_alive_interval_s):
            try:
                self.beat()
                self.note_up()
            except etcd.EtcdException as exc:
                self.note_down(exc)

    def _watch(self) -> None:
        """Keep ``view`` current: read the directory, then wait for its next change."""
        while not self.stop.is_set():
            try:
                view = self.read_view()
                self._keep(view)
                with self._changed:
                    self._changed.notify_all()
                self._watch_client.read(
                    self.root,
                    wait=True,
                    recursive=True,
                    waitIndex=view.etcd_index + 1,
                    timeout=self.timing.keep_alive_interval_s * 5,
                )
            except etcd.EtcdWatchTimedOut:
                continue
            except etcd.EtcdEventIndexCleared:
                continue  # fell behind etcd's event history: the next read catches up
            except etcd.EtcdException as exc:
                self.note_down(exc)
                self.stop.wait(self.timing.keep_alive_interval_s / 2)
            except Exception as exc:  # noqa: BLE001 - a watch must never kill the agent
                logger.warning("rendezvous watch: %s", exc)
                self.stop.wait(self.timing.keep_alive_interval_s / 2)

    def wait_for_change(self, timeout_s: float) -> None:
        with self._changed:
            self._changed.wait(timeout_s)

    def leave(self) -> None:
        """Leave for good, at once: the port refuses, the key says so, the join is withdrawn."""
        if self.probe is None or self.stop.is_set():
            return
        self.stop.set()
        self.probe.close()
        self.release_port()
        try:
            self.client.write(
                f"{self.root}/nodes/{self.node}",
                self._node_info(left=True),
                ttl=max(self.timing.join_timeout_s, 60),
            )
        except etcd.EtcdException as exc:  # the refused probe says it all the same
            logger.warning("could not mark node %s as left: %s", self.node, exc)
        if self.joined_round:
            # An open round must not make a departed node a member (the others would wait
            # for it as their rank 0); a completed round ignores the key.
            with contextlib.suppress(etcd.EtcdException):
                self.client.delete(f"{self.root}/join/{self.joined_round}/{self.node}")
