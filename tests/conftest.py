"""Shared fixtures: a real Azurite Blob endpoint, the two checkpoint object stores, and what
a trainer's tests run on (a tiny dataset, a gloo group of one: tests/support/trainer_harness.py).

``object_store`` runs a test once per backend (ids ``file`` and ``blob``), so the checkpoint
protocol is proven on a directory and on the Blob API alike.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

# The fixtures of the lab's Azure tools' tests, each on loopback: a recorded subscription
# (``azure``), the local tools faked on PATH (``tools``), Docker Hub's answers for the
# Dockerfiles' bases (``hub``).
from tests.support.lab_azure_fixtures import subscription_served, tools_on_path  # noqa: F401
from tests.support.registry_replay import hub_for_preflight  # noqa: F401
from training.checkpoints.storage import FileStore, ObjectStore

REPO_ROOT = Path(__file__).resolve().parents[1]
AZURITE_BLOB = REPO_ROOT / "node_modules" / ".bin" / "azurite-blob"
# Azurite's documented development account; the key is public, not a secret.
DEV_ACCOUNT = "devstoreaccount1"
DEV_ACCOUNT_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)
AZURITE_START_TIMEOUT_S = 30.0


def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def _wait_until_listening(proc: subprocess.Popen[bytes], port: int, log: Path) -> None:
    deadline = time.monotonic() + AZURITE_START_TIMEOUT_S
    while not _answers(port):
        if proc.poll() is not None:
            raise RuntimeError(f"azurite exited with {proc.returncode}:\n{log.read_text()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"azurite did not listen on {port} in time:\n{log.read_text()}")
        time.sleep(0.1)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    # Azurite runs in its own session: signal its group so no node child outlives the tests.
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="session")
def azurite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Azurite Blob service on a free loopback port; yields its connection string."""
    if not AZURITE_BLOB.exists():
        pytest.fail(
            f"Azurite is not installed ({AZURITE_BLOB} is missing): "
            "run `make test`, or `npm install` in the repo root first"
        )
    workspace = tmp_path_factory.mktemp("azurite")
    log = workspace / "azurite.log"
    port = free_loopback_port()
    args = [str(AZURITE_BLOB), "--blobHost", "127.0.0.1", "--blobPort", str(port)]
    args += ["--location", str(workspace), "--skipApiVersionCheck", "--loose"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=workspace
        )
    try:
        _wait_until_listening(proc, port, log)
        yield (
            f"DefaultEndpointsProtocol=http;AccountName={DEV_ACCOUNT};"
            f"AccountKey={DEV_ACCOUNT_KEY};BlobEndpoint={azurite_account_url(port)};"
        )
    finally:
        _stop(proc)


def azurite_account_url(port: int) -> str:
    """Azurite's path-style account URL on ``port``."""
    return f"http://127.0.0.1:{port}/{DEV_ACCOUNT}"


@pytest.fixture
def azurite_account(azurite: str) -> str:
    """The account URL of the running Azurite (``http://127.0.0.1:<port>/devstoreaccount1``)."""
    fields = dict(part.split("=", 1) for part in azurite.split(";") if part)
    return fields["BlobEndpoint"]


@pytest.fixture
def blob_container_uri(azurite_account: str) -> str:
    """A URI for a fresh, not yet created container in Azurite (no prefix)."""
    return f"{azurite_account}/t{uuid.uuid4().hex[:20]}"


@pytest.fixture
def unused_loopback_port() -> int:
    """A loopback port with nothing listening: an unreachable endpoint."""
    return free_loopback_port()


@pytest.fixture
def file_store(tmp_path: Path) -> FileStore:
    """A FileStore in this test's temporary directory."""
    return FileStore(tmp_path / "store")


@pytest.fixture
def blob_store(
    azurite: str, blob_container_uri: str, monkeypatch: pytest.MonkeyPatch
) -> ObjectStore:
    """A BlobStore on a fresh Azurite container, authenticated by the connection string."""
    from training.checkpoints.blob_store import BlobStore

    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite)
    return BlobStore.from_uri(f"{blob_container_uri}/ckpt")


@pytest.fixture(params=["file", "blob"])
def object_store(request: pytest.FixtureRequest) -> ObjectStore:
    """Each ObjectStore backend in turn; only the ``blob`` run starts Azurite."""
    return request.getfixturevalue(f"{request.param}_store")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny synthetic dataset for a trainer (torch is imported only by tests that use it)."""
    from tests.support.trainer_harness import make_data_dir

    return make_data_dir(tmp_path_factory)


@pytest.fixture
def world_of_one() -> Iterator[None]:
    """A gloo default group of one, for a trainer in this process."""
    from tests.support.trainer_harness import one_process_world

    with one_process_world():
        yield
