"""The training tests' shared fixture: one embedded etcd per test module (a run's rendezvous
keys carry its own run id, so the tests of a module never see each other's)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from lab.local.etcd_server import EmbeddedEtcd, find_etcd_binary


@pytest.fixture(scope="module")
def etcd_server(tmp_path_factory: pytest.TempPathFactory, etcd: None) -> Iterator[EmbeddedEtcd]:
    root = tmp_path_factory.mktemp("etcd")
    with EmbeddedEtcd(find_etcd_binary(), root / "data", root / "etcd.log") as server:
        yield server
