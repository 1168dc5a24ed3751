"""A started ``Membership`` of node "a" in a run of its own, on the module's etcd."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from lab.local.etcd_server import EmbeddedEtcd
from training.elastic.etcd_v3 import Etcd, KeyValue
from training.elastic.liveness import Progress
from training.elastic.membership import Membership
from training.elastic.rounds import Timing


class CountingEtcd(Etcd):
    """An etcd client that counts its range reads."""

    ranges = 0

    def range(
        self, prefix: str, end: str | None = None, first: int = 0
    ) -> tuple[list[KeyValue], int]:
        self.ranges += 1
        return super().range(prefix, end, first)


@pytest.fixture
def membership(etcd_server: EmbeddedEtcd) -> Iterator[Membership]:
    """Node "a", its client counting range reads; its watch runs."""
    port = etcd_server.client_port
    keys = Membership(
        CountingEtcd("127.0.0.1", port),
        Etcd("127.0.0.1", port),
        f"run-{time.monotonic_ns()}",
        "a",
        "127.0.0.1",
        Timing(keep_alive_interval_s=1, keep_alive_max_attempt=2),
        Progress(60),
    )
    keys.start()
    yield keys
    keys.leave()
