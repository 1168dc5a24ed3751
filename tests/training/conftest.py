"""The training tests' shared fixture: one embedded etcd for the whole session (a run's
rendezvous keys carry its own run id, so no two tests see each other's; a test that stops it
starts it again on the same ports, and one that must stop it for good makes its own)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from lab.local.etcd_server import EmbeddedEtcd, find_etcd_binary


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory, etcd: None) -> Iterator[EmbeddedEtcd]:
    root = tmp_path_factory.mktemp("etcd")
    with EmbeddedEtcd(find_etcd_binary(), root / "data", root / "etcd.log") as server:
        yield server
