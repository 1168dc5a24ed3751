"""The workers copy the dataset to node-local disk before they join: on the cluster from the
read-only Blob CSI mount (a directory), elsewhere from Blob Storage with their own identity."""

from __future__ import annotations

from pathlib import Path

import pytest

from training import agent
from training.checkpoints.blob_store import BlobStore
from training.data.cifar10 import load_cifar10_binary, write_synthetic_cifar10
from training.data.fetch_data import MARKER, DataFetchError, fetch_dataset
from training.elastic.exit_codes import BAD_INPUT, RETRY_ME
from training.elastic.launch import DATA_DIR_ENV, DATA_URI_ENV


@pytest.fixture
def data_uri(
    azurite: str, blob_container_uri: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> str:
    """A container prefix holding a small synthetic CIFAR-10, as staging leaves it."""
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite)
    uri = f"{blob_container_uri}/cifar-10-batches-bin"
    store = BlobStore.from_uri(uri)
    for path in write_synthetic_cifar10(
        tmp_path / "source", train_records=30, test_records=10, train_files=2
    ):
        store.put(path.name, path.read_bytes())
    store.put("readme.html", b"not a batch file")
    return uri


def test_the_batches_are_copied_and_load(data_uri: str, tmp_path: Path) -> None:
    files = fetch_dataset(data_uri, tmp_path / "local")
    assert sorted(p.name for p in files) == [
        "data_batch_1.bin",
        "data_batch_2.bin",
        "test_batch.bin",
    ]
    source = load_cifar10_binary(tmp_path / "source")
    copied = load_cifar10_binary(tmp_path / "local")
    assert copied.digest == source.digest
    assert not (tmp_path / "local" / "readme.html").exists()


def test_a_second_fetch_into_the_same_directory_downloads_nothing(
    data_uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fetch_dataset(data_uri, tmp_path / "local")

    def no_download(self: BlobStore, name: str) -> bytes:
        raise AssertionError(f"downloaded {name} again")

    monkeypatch.setattr(BlobStore, "get", no_download)
    assert len(fetch_dataset(data_uri, tmp_path / "local")) == 3


def test_a_copy_cut_short_is_copied_again(data_uri: str, tmp_path: Path) -> None:
    local = tmp_path / "local"
    fetch_dataset(data_uri, local)
    (local / "data_batch_2.bin").write_bytes(b"\0" * 10)  # a copy that stopped part way
    fetch_dataset(data_uri, local)
    assert load_cifar10_binary(local).digest == load_cifar10_binary(tmp_path / "source").digest


def test_an_empty_container_is_a_dataset_error_that_says_how_to_fill_it(
    azurite: str, blob_container_uri: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite)
    with pytest.raises(DataFetchError, match="no data_batch_N.bin nor input.txt.*--auth-mode"):
        fetch_dataset(f"{blob_container_uri}/cifar", tmp_path / "local")


def test_a_refusal_is_retried_while_a_new_role_applies(
    data_uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    refusals = [PermissionError("403 AuthorizationPermissionMismatch")] * 2
    real_list = BlobStore.list

    def list_after_refusals(self: BlobStore, prefix: str = "") -> list[str]:
        if refusals:
            raise refusals.pop()
        return real_list(self, prefix)

    monkeypatch.setattr(BlobStore, "list", list_after_refusals)
    waits: list[float] = []
    assert len(fetch_dataset(data_uri, tmp_path / "local", sleep=waits.append)) == 3
    assert len(waits) == 2


def test_a_lasting_refusal_names_the_role_it_needs(
    data_uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refused(self: BlobStore, prefix: str = "") -> list[str]:
        raise PermissionError("403 AuthorizationPermissionMismatch")

    monkeypatch.setattr(BlobStore, "list", refused)
    with pytest.raises(
        DataFetchError, match="needs Storage Blob Data Reader on the data container"
    ):
        fetch_dataset(data_uri, tmp_path / "local", role_wait_s=0, sleep=lambda s: None)
    assert not (tmp_path / "local" / MARKER).exists()


# ---- from the read-only mount (the cluster's path) ----------------------------------------------


@pytest.fixture
def mount(tmp_path: Path) -> Path:
    """A directory as blobfuse2 shows the data container: the batches at its root, read-only."""
    root = tmp_path / "mnt" / "dataset"
    root.mkdir(parents=True)
    write_synthetic_cifar10(root, train_records=30, test_records=10, train_files=2)
    (root / "readme.html").write_text("not a batch file")
    (root / "cifar-10-batches-bin").mkdir()  # a folder in the container is not a batch
    for path in root.iterdir():
        if path.is_file():
            path.chmod(0o444)
    root.chmod(0o555)
    yield root
    root.chmod(0o755)


def test_the_batches_are_copied_from_the_mount_and_load(mount: Path, tmp_path: Path) -> None:
    files = fetch_dataset(str(mount), tmp_path / "local")
    assert sorted(p.name for p in files) == [
        "data_batch_1.bin",
        "data_batch_2.bin",
        "test_batch.bin",
    ]
    assert load_cifar10_binary(tmp_path / "local").digest == load_cifar10_binary(mount).digest
    # A container restart in the same pod finds the copy and reads the mount no more.
    assert len(fetch_dataset(str(mount), tmp_path / "local")) == 3


def test_a_mount_the_identity_may_not_read_is_retried_then_names_the_role(
    mount: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # blobfuse2 answers EACCES when the token's identity lost its role on the container.
    def refused(self: Path) -> object:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "iterdir", refused)
    waits: list[float] = []
    with pytest.raises(DataFetchError, match="Storage Blob Data Reader on the data container"):
        fetch_dataset(str(mount), tmp_path / "local", role_wait_s=0, sleep=waits.append)


def test_a_missing_mount_is_bad_input_that_names_the_path(tmp_path: Path) -> None:
    code, launched = _agent(
        {DATA_URI_ENV: str(tmp_path / "not-mounted"), DATA_DIR_ENV: str(tmp_path / "local")}
    )
    assert (code, launched) == (BAD_INPUT, [])
    with pytest.raises(DataFetchError, match="not a directory: the dataset volume is not mounted"):
        fetch_dataset(str(tmp_path / "not-mounted"), tmp_path / "local")


def test_a_broken_mount_asks_for_a_new_pod(
    mount: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A FUSE mount whose daemon died: ENOTCONN, "Transport endpoint is not connected".
    def disconnected(self: Path) -> bytes:
        raise OSError(107, "Transport endpoint is not connected", str(self))

    monkeypatch.setattr(Path, "read_bytes", disconnected)
    env = {DATA_URI_ENV: str(mount), DATA_DIR_ENV: str(tmp_path / "local")}
    assert _agent(env) == (RETRY_ME, [])


def test_the_agent_copies_from_the_mount_before_it_launches(mount: Path, tmp_path: Path) -> None:
    code, launched = _agent({DATA_URI_ENV: str(mount), DATA_DIR_ENV: str(tmp_path / "local")})
    assert code == 0 and len(launched) == 1
    assert (tmp_path / "local" / MARKER).exists()


# ---- the agent: before it joins ------------------------------------------------------------


def _agent(env: dict[str, str]) -> tuple[int, list[list[str]]]:
    launched: list[list[str]] = []
    code = agent.main(
        ["--module", "training.train"],
        env={"TRAIN_LAUNCHER": "torchrun", **env},
        execv=lambda path, argv: launched.append(argv),
    )
    return code, launched


def test_the_agent_copies_the_data_before_it_launches(data_uri: str, tmp_path: Path) -> None:
    code, launched = _agent({DATA_URI_ENV: data_uri, DATA_DIR_ENV: str(tmp_path / "local")})
    assert code == 0 and len(launched) == 1
    assert (tmp_path / "local" / MARKER).exists()


def test_the_agent_stops_at_once_on_an_empty_container(
    azurite: str, blob_container_uri: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite)
    env = {DATA_URI_ENV: f"{blob_container_uri}/x", DATA_DIR_ENV: str(tmp_path / "d")}
    assert _agent(env) == (BAD_INPUT, [])


def test_an_unreachable_store_asks_for_a_new_pod(
    unused_loopback_port: int, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", "UseDevelopmentStorage=true")
    uri = f"http://127.0.0.1:{unused_loopback_port}/devstoreaccount1/data/x"
    assert _agent({DATA_URI_ENV: uri, DATA_DIR_ENV: str(tmp_path / "d")}) == (RETRY_ME, [])


def test_a_data_uri_without_a_directory_is_bad_input(tmp_path: Path) -> None:
    assert _agent({DATA_URI_ENV: "https://a.blob.core.windows.net/data"}) == (BAD_INPUT, [])
