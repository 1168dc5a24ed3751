"""The run's keys as one agent's watch keeps them: a copy that each watch event updates, and
the ``View`` (training/elastic/rounds.py) taken from it when asked.

A watch event carries the key's new value, so the copy is kept without reading the run's
keys again: a change costs each agent the decoding of the one key that changed. Re-reading
the run's keys on every wake-up cost each agent all of them (every node's key and join), so
N agents re-formed with about N changes, each re-read by N agents, of about 2N keys each.

The joins are not in every agent's copy: N joins sent to N watches cost etcd N^2 messages a
re-form. Only a node that may complete the round follows them (``Joins``).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from training.elastic.etcd_v3 import Backoff, Etcd, EtcdError, Event, KeyValue, WatchCompacted
from training.elastic.reachability import REFUSED, parse_report
from training.elastic.rounds import Me, Reached, View, needs_joins

logger = logging.getLogger(__name__)

HEAD = 8
"""How many of a round's first joiners a new node reads to find one ahead of it."""


class KeyCopy:
    """The keys under ``root``, as of ``revision``; safe to update from the watch's thread
    while other threads take views."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.revision = 0
        """Every change up to this revision is in the copy (0: nothing read yet)."""
        self._lock = threading.Lock()
        self._state: dict[str, Any] | None = None
        self._state_index = 0
        self._nodes: dict[str, dict[str, Any]] = {}
        self._joined: dict[int, dict[str, dict[str, Any]]] = {}
        """Per round, the joiners in the order of their keys' creation (the watch delivers
        changes in revision order, a read is sorted by creation revision)."""
        self._reports: dict[str, set[str]] = {}
        """Per reporter, the peers it cannot reach (training/elastic/reachability.py)."""
        self._refused: set[tuple[str, str]] = set()
        """The reports whose probe was refused, as (reporter, target)."""
        self._read_at = 0.0
        self._view: View | None = None

    def _parts(self, key: str) -> list[str]:
        return key[len(self.root) :].strip("/").split("/")

    def load(self, kvs: list[KeyValue], revision: int) -> dict[str, dict[str, Any]]:
        """Replace the copy by one range read of the keys at ``revision`` (unless the copy
        is newer: the watch applied later changes meanwhile); the nodes read."""
        with self._lock:
            if revision < self.revision:
                return {}
            self._state, self._state_index = None, 0
            self._nodes, self._joined, self._reports = {}, {}, {}
            self._refused = set()
            for kv in sorted(kvs, key=lambda kv: kv.create_revision):
                self._put(kv)
            self.revision = revision
            self._touched()
            return dict(self._nodes)

    def apply(self, events: list[Event]) -> dict[str, dict[str, Any]]:
        """The changes of one watch response; the nodes whose keys they wrote."""
        written: dict[str, dict[str, Any]] = {}
        with self._lock:
            known = self.revision
            for event in events:
                if event.kv.mod_revision <= known:
                    continue  # in the copy already: a read since the watch started had it
                if event.deleted:
                    self._drop(event.kv.key)
                else:
                    node = self._put(event.kv)
                    if node is not None:
                        written[node] = self._nodes[node]
                self.revision = max(self.revision, event.kv.mod_revision)
            self._touched()
        return written

    def advance(self, revision: int) -> None:
        """A watch's progress notification: no change under the root up to ``revision``."""
        with self._lock:
            self.revision = max(self.revision, revision)

    def view(self) -> View:
        """The copy as a View (a snapshot: later changes do not alter it)."""
        with self._lock:
            if self._view is None:
                self._view = View(
                    state=self._state,
                    state_index=self._state_index,
                    nodes=dict(self._nodes),
                    joined={round_: dict(nodes) for round_, nodes in self._joined.items()},
                    reports={reporter: set(t) for reporter, t in self._reports.items()},
                    refused=set(self._refused),
                    etcd_index=self.revision,
                    read_at=self._read_at,
                )
            return self._view

    def _touched(self) -> None:
        self._read_at = time.monotonic()
        self._view = None

    def _put(self, kv: KeyValue) -> str | None:
        """Put one key in the copy; the node's id when it is a node's key."""
        rel = self._parts(kv.key)
        if rel == ["state"] and kv.value:
            self._state, self._state_index = json.loads(kv.value), kv.mod_revision
        elif len(rel) == 2 and rel[0] == "nodes" and kv.value:
            self._nodes[rel[1]] = json.loads(kv.value)
            return rel[1]
        elif len(rel) == 3 and rel[0] == "join":
            self._joined.setdefault(int(rel[1]), {})[rel[2]] = json.loads(kv.value or "{}")
        elif report := parse_report(rel):
            self._reports.setdefault(report[0], set()).add(report[1])
            (self._refused.add if kv.value == REFUSED else self._refused.discard)(report)
        return None

    def _drop(self, key: str) -> None:
        rel = self._parts(key)
        if rel == ["state"]:
            self._state, self._state_index = None, 0
        elif len(rel) == 2 and rel[0] == "nodes":
            self._nodes.pop(rel[1], None)
        elif len(rel) == 3 and rel[0] == "join":
            joined = self._joined.get(int(rel[1]), {})
            joined.pop(rel[2], None)
            if not joined:
                self._joined.pop(int(rel[1]), None)
        elif report := parse_report(rel):
            self._refused.discard(report)
            targets = self._reports.get(report[0], set())
            targets.discard(report[1])
            if not targets:
                self._reports.pop(report[0], None)


class Joins:
    """The joins under ``root``, for the node that may complete the open round
    (``rounds.needs_joins``): one range read, then a watch of their changes on a thread of
    its own, which wakes the rendezvous loop (``changed``) as the node's other watch does."""

    def __init__(self, client: Etcd, watch_client: Etcd, root: str, changed: Callable[[], None]):
        self._client, self._watch_client, self._root = client, watch_client, root
        self._changed = changed
        self._prefix = f"{root}/join/"
        self._copy: KeyCopy | None = None
        self._head: tuple[int, list[str]] = (0, [])

    def for_view(self, view: View, me: Me, reached: Reached) -> View:
        """``view`` with the joins when this node may complete the open round; else as it
        is (no joins), and the joins are no longer followed."""
        fresh: list[bool] = []

        def head() -> list[str]:
            if self._head[0] != me.joined_round:
                kvs, _ = self._client.range(f"{self._prefix}{me.joined_round}/", first=HEAD)
                self._head = (me.joined_round, [kv.key.rsplit("/", 1)[1] for kv in kvs])
                fresh.append(True)
            return self._head[1]

        needs = needs_joins(view, me, reached, head)
        if needs and self._head[0] == me.joined_round and not fresh:
            self._head = (0, [])  # the head read before serves no one now: read it again
            needs = needs_joins(view, me, reached, head)
        if not needs:
            self.drop()
            return view
        return replace(view, joined=self.joined())

    @property
    def following(self) -> bool:
        return self._copy is not None

    def joined(self) -> dict[int, dict[str, dict[str, Any]]]:
        """Per round, the joiners in the order they joined (read once, then followed)."""
        copy = self._copy
        if copy is None:
            copy = KeyCopy(self._root)
            copy.load(*self._client.range(self._prefix))
            self._copy = copy
            threading.Thread(
                target=self._follow, args=(copy,), name="rdzv-joins", daemon=True
            ).start()
        return copy.view().joined

    def _follow(self, copy: KeyCopy) -> None:
        """Apply the joins' changes to ``copy`` while it is the one followed; a quiet stream
        ends after a second and the next starts where it ended. A broken one (compacted, etcd
        away, an error line) lets the next look read the joins again, after a first backoff
        (etcd_v3.py) when it was no compaction: never a storm of reopened streams."""
        try:
            while self._copy is copy:
                for events in self._watch_client.watch(
                    self._prefix, copy.revision, 1.0, progress=copy.advance
                ):
                    if self._copy is not copy:
                        return
                    copy.apply(events)
                    self._changed()
        except Exception as exc:  # noqa: BLE001 - compacted, etcd away, or worse: read again
            if not isinstance(exc, EtcdError):
                logger.warning("rendezvous joins watch: %s", exc)
            if not isinstance(exc, WatchCompacted):
                time.sleep(Backoff().next())
            if self._copy is copy:
                self._copy = None  # the next look reads them again
                self._changed()

    def drop(self) -> None:
        """Stop following (its thread ends with its stream): another node completes the
        round, or none is open."""
        self._copy = None
