"""Shared fixtures: a real Azurite Blob endpoint, the two checkpoint object stores, and what
a trainer's tests run on (a tiny dataset, a gloo group of one: tests/support/trainer_harness.py).

``object_store`` runs a test once per backend (ids ``file`` and ``blob``), so the checkpoint
protocol is proven on a directory and on the Blob API alike.

The two tiers (tests/support/tiers.py): a test's markers follow from the fixtures it uses, and
a test that starts a process without declaring it fails; ``make test-fast`` runs ``-m "not
slow"``.

``make test`` runs the suite on two workers (pytest-xdist, ``--dist loadgroup``): every fixture
here is per worker (a session fixture is set up once in each, in that worker's own temporary
directory, on free ports), and a test that uses a module's fixture, or ``heavy``, runs on one
worker with the rest of its group (``worker_group`` in tests/support/tiers.py).
"""

from __future__ import annotations

import shutil
import signal
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lab.local import azurite_server as azurite_emulator

# The fixtures of the lab's Azure tools' tests, each on loopback: a recorded subscription
# (``azure``), the local tools faked on PATH (``tools``), Docker Hub's answers for the
# Dockerfiles' bases (``hub``).
from tests.support.lab_azure_fixtures import subscription_served, tools_on_path  # noqa: F401
from tests.support.loopback import free_port
from tests.support.registry_replay import hub_for_preflight  # noqa: F401
from tests.support.tiers import (
    GROUPS_DIR,
    MARKERS,
    WorkerGroups,
    mark_by_fixtures,
    no_undeclared_process,
    write_groups,
)
from training.checkpoints.storage import FileStore, ObjectStore

REPO_ROOT = Path(__file__).resolve().parents[1]
# Azurite's documented development account; the key is public, not a secret.
DEV_ACCOUNT, DEV_ACCOUNT_KEY = azurite_emulator.ACCOUNT, azurite_emulator.ACCOUNT_KEY


def pytest_configure(config: pytest.Config) -> None:
    for name, meaning in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {meaning}")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        mark_by_fixtures(item)


_GROUPS_DIR = pytest.StashKey[Path]()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> WorkerGroups | None:
    """``--dist loadgroup`` keeps each group of ``worker_group`` on one worker."""
    if config.getvalue("dist") != "loadgroup":
        return None
    return WorkerGroups(config, log, _groups_dir(config))


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    if node.config.getvalue("dist") == "loadgroup":
        node.workerinput[GROUPS_DIR] = str(_groups_dir(node.config))


def _groups_dir(config: pytest.Config) -> Path:
    if _GROUPS_DIR not in config.stash:
        config.stash[_GROUPS_DIR] = Path(tempfile.mkdtemp(prefix="worker-groups-"))
    return config.stash[_GROUPS_DIR]


def pytest_unconfigure(config: pytest.Config) -> None:
    if _GROUPS_DIR in config.stash:
        shutil.rmtree(config.stash[_GROUPS_DIR], ignore_errors=True)


# First: the worker reports its collection to the scheduler in a hook of its own.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    write_groups(session.config, session.items)


# Each phase of a test that is not marked ``processes``, its fixtures' setup and teardown included
# (a module's fixture is set up in its first test's setup), may start no process.
@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    with no_undeclared_process(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    with no_undeclared_process(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    with no_undeclared_process(item):
        return (yield)


@pytest.fixture(autouse=True)
def _signal_mask_restored() -> Iterator[None]:
    """A trainer's StopRequest blocks SIGTERM in this thread for its sigwait thread
    (training/elastic/faults.py); the next test, and every process it starts, inherit this
    thread's mask unless it is put back."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, set())
    yield
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)


# Declarations, session-scoped so a fixture of any scope can make them.
@pytest.fixture(scope="session")
def processes() -> None:
    """Declares that the test starts real child processes (a CLI, a fake tool, spawned ranks):
    it runs in ``make test``, not in ``make test-fast``."""


@pytest.fixture(scope="session")
def torchrun(processes: None) -> None:
    """Declares that the test runs real torchrun agents and their workers."""


@pytest.fixture(scope="session")
def etcd(processes: None) -> None:
    """Declares that the test starts a real etcd."""


@pytest.fixture(scope="session")
def heavy() -> None:
    """Declares that the test loads the whole machine for a minute or more (both cores, or
    several multi-process runs at once): with workers, every such test runs on one, in turn."""


@pytest.fixture(scope="session")
def training() -> None:
    """Declares that the test trains a real model for many steps (seconds of CPU each):
    an exactness or a convergence test, in ``make test`` only."""


@pytest.fixture(scope="session")
def azurite(tmp_path_factory: pytest.TempPathFactory, processes: None) -> Iterator[str]:
    """A real Azurite Blob service on a free loopback port; yields its connection string."""
    with azurite_emulator.serve(tmp_path_factory.mktemp("azurite")) as port:
        yield (
            f"DefaultEndpointsProtocol=http;AccountName={DEV_ACCOUNT};"
            f"AccountKey={DEV_ACCOUNT_KEY};BlobEndpoint={azurite_account_url(port)};"
        )


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
    return free_port()


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


# The blob run starts Azurite through getfixturevalue, which the tier hook cannot see.
BLOB_RUN = pytest.param(
    "blob", marks=[pytest.mark.azurite, pytest.mark.processes, pytest.mark.slow]
)


@pytest.fixture(params=["file", BLOB_RUN])
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
