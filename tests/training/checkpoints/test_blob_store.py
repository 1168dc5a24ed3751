"""The Azure Blob checkpoint backend, against a real Azurite and its URI/credential rules."""

from __future__ import annotations

import base64
import os
import socket
import threading
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path
from typing import Any

import pytest
from azure.core.exceptions import AzureError, ClientAuthenticationError
from azure.identity import DefaultAzureCredential
from azure.storage.blob import BlobBlock, ContainerClient

from training.checkpoints.blob_store import (
    CONNECTION_STRING_ENV,
    DEV_ACCOUNT,
    DEV_ACCOUNT_KEY,
    BlobLocation,
    BlobStore,
    credential_from_env,
    parse_blob_uri,
)
from training.checkpoints.deadline import Deadline
from training.checkpoints.storage import ObjectStore
from training.checkpoints.stores import open_store

AZURE_URI = "https://acct01.blob.core.windows.net/checkpoints/runs/r1"


def _sdk_container(connection_string: str, uri: str) -> ContainerClient:
    """A raw SDK client on the container a store URI names, to look behind the store."""
    location = parse_blob_uri(uri)
    return ContainerClient.from_connection_string(connection_string, location.container)


# --- The ObjectStore contract, on both backends -------------------------------------------


def test_put_get_overwrite_delete(object_store: ObjectStore) -> None:
    object_store.put("a.bin", b"first")
    assert object_store.get("a.bin") == b"first"
    object_store.put("a.bin", b"second, longer")
    assert object_store.get("a.bin") == b"second, longer"
    object_store.delete("a.bin")
    with pytest.raises(FileNotFoundError):
        object_store.get("a.bin")


def test_missing_object_raises_file_not_found(object_store: ObjectStore) -> None:
    with pytest.raises(FileNotFoundError):
        object_store.get("never-written")


def test_size_is_the_stored_size_and_a_missing_object_has_none(object_store: ObjectStore) -> None:
    object_store.put("a.pt", b"x" * 1234)
    assert object_store.size("a.pt") == 1234
    with pytest.raises(FileNotFoundError):
        object_store.size("never-written")


def test_delete_missing_is_not_an_error(object_store: ObjectStore) -> None:
    object_store.delete("never-written")
    assert object_store.list() == []


def test_list_is_sorted_and_filters_by_prefix(object_store: ObjectStore) -> None:
    for name in ("step-00020.pt", "manifest.json", "step-00010.pt", "empty"):
        object_store.put(name, name.encode() if name != "empty" else b"")
    assert object_store.list() == ["empty", "manifest.json", "step-00010.pt", "step-00020.pt"]
    assert object_store.list("step-") == ["step-00010.pt", "step-00020.pt"]
    assert object_store.get("empty") == b""


@pytest.mark.parametrize("name", ["", "a/b", ".hidden", "../escape"])
def test_bad_object_names_are_rejected(object_store: ObjectStore, name: str) -> None:
    with pytest.raises(ValueError, match="invalid object name"):
        object_store.put(name, b"x")


# --- Blob specifics, against Azurite --------------------------------------------------------


def test_container_is_created_on_first_put(
    azurite: str, blob_container_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CONNECTION_STRING_ENV, azurite)
    store = BlobStore.from_uri(f"{blob_container_uri}/ckpt")
    sdk = _sdk_container(azurite, blob_container_uri)
    assert not sdk.exists()
    assert store.list() == []
    store.put("x", b"1")
    assert sdk.exists()
    assert [b.name for b in sdk.list_blobs()] == ["ckpt/x"]


def test_open_store_picks_blob_for_http_uris(
    azurite: str, blob_container_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CONNECTION_STRING_ENV, azurite)
    store = open_store(f"{blob_container_uri}/ckpt")
    assert isinstance(store, BlobStore)
    assert store.describe() == f"{blob_container_uri}/ckpt"
    assert azurite.split("AccountKey=")[1].split(";")[0] not in repr(store)


def test_prefixes_in_one_container_are_isolated(
    azurite: str, blob_container_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CONNECTION_STRING_ENV, azurite)
    run = BlobStore.from_uri(f"{blob_container_uri}/run")
    run_2 = BlobStore.from_uri(f"{blob_container_uri}/run-2")
    nested = BlobStore.from_uri(f"{blob_container_uri}/run/sub")
    run.put("m", b"run")
    run_2.put("m", b"run-2")
    nested.put("n", b"nested")
    assert run.list() == ["m"]
    assert run_2.list() == ["m"]
    assert nested.list() == ["n"]
    assert (run.get("m"), run_2.get("m")) == (b"run", b"run-2")
    run.delete("m")
    assert run_2.get("m") == b"run-2"
    with pytest.raises(FileNotFoundError):
        nested.get("m")


def test_large_object_is_committed_as_a_block_list(
    azurite: str, blob_container_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CONNECTION_STRING_ENV, azurite)
    store = BlobStore.from_uri(f"{blob_container_uri}/ckpt", max_single_put_bytes=64 * 1024)
    data = os.urandom(300 * 1024)
    store.put("big.pt", data)
    assert store.get("big.pt") == data
    committed, _ = (
        _sdk_container(azurite, blob_container_uri)
        .get_blob_client("ckpt/big.pt")
        .get_block_list("all")
    )
    assert len(committed) == 5  # 300 KiB in 64 KiB blocks: the block path really ran


def test_staged_blocks_are_invisible_until_committed(
    azurite: str, blob_container_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer killed between Put Block and Put Block List leaves no torn object behind."""
    monkeypatch.setenv(CONNECTION_STRING_ENV, azurite)
    store = BlobStore.from_uri(f"{blob_container_uri}/ckpt")
    store.put("manifest.json", b"old")
    sdk = _sdk_container(azurite, blob_container_uri)
    block_id = base64.b64encode(b"block-0").decode()
    for name in ("manifest.json", "half-written.pt"):
        sdk.get_blob_client(f"ckpt/{name}").stage_block(block_id, b"new, never committed")
    assert store.get("manifest.json") == b"old"
    assert store.list() == ["manifest.json"]
    with pytest.raises(FileNotFoundError):
        store.get("half-written.pt")
    sdk.get_blob_client("ckpt/half-written.pt").commit_block_list([BlobBlock(block_id)])
    assert store.get("half-written.pt") == b"new, never committed"


def test_wrong_account_key_is_a_clear_permission_error(
    azurite: str, blob_container_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    wrong_key = base64.b64encode(b"not the azurite key".ljust(64, b"!")).decode()
    monkeypatch.setenv(CONNECTION_STRING_ENV, azurite.replace(DEV_ACCOUNT_KEY, wrong_key))
    store = BlobStore.from_uri(f"{blob_container_uri}/ckpt", retries=0)
    with pytest.raises(PermissionError) as err:
        store.put("x", b"1")
    assert blob_container_uri in str(err.value)
    assert CONNECTION_STRING_ENV in str(err.value)
    assert wrong_key not in str(err.value)


class _NoIdentity:
    """A token credential with no identity behind it, as on a pod without workload identity."""

    def get_token(self, *scopes: str, **kwargs: object) -> object:
        raise ClientAuthenticationError("no managed identity endpoint available")


def test_missing_identity_is_a_clear_permission_error(unused_loopback_port: int) -> None:
    # https on loopback: tokens need https, and nothing leaves this machine if one were sent.
    uri = f"https://127.0.0.1:{unused_loopback_port}/{DEV_ACCOUNT}/ckpt/run"
    store = BlobStore(parse_blob_uri(uri), _NoIdentity(), retries=0)
    with pytest.raises(PermissionError) as err:
        store.get("x")
    for expected in (uri, "workload identity", CONNECTION_STRING_ENV, "no managed identity"):
        assert expected in str(err.value)


def test_dead_endpoint_is_a_clear_connection_error(
    unused_loopback_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = unused_loopback_port
    monkeypatch.setenv(CONNECTION_STRING_ENV, f"AccountName={DEV_ACCOUNT};AccountKey=a2V5")
    store = BlobStore.from_uri(f"http://127.0.0.1:{port}/{DEV_ACCOUNT}/ckpt/run", retries=0)
    for operation in (lambda: store.put("x", b"1"), lambda: store.get("x"), store.list):
        with pytest.raises(ConnectionError, match=f"127.0.0.1:{port}/{DEV_ACCOUNT}/ckpt/run"):
            operation()


def test_any_other_sdk_error_is_an_os_error_naming_the_uri(
    unused_loopback_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # E.g. a download stream cut mid-way: the resume agreement handles OSError, nothing else.
    monkeypatch.setenv(CONNECTION_STRING_ENV, f"AccountName={DEV_ACCOUNT};AccountKey=a2V5")
    uri = f"http://127.0.0.1:{unused_loopback_port}/{DEV_ACCOUNT}/ckpt/run"
    store = BlobStore.from_uri(uri, retries=0)

    def cut(*args: object, **kwargs: object) -> None:
        raise AzureError("the connection dropped while reading the body")

    monkeypatch.setattr(store._container, "download_blob", cut)
    with pytest.raises(OSError, match=f"get 'x' in {uri}: Azure SDK error"):
        store.get("x")


# --- URI parsing ----------------------------------------------------------------------------


def test_parse_azure_uri() -> None:
    assert parse_blob_uri(AZURE_URI) == BlobLocation(
        account_url="https://acct01.blob.core.windows.net",
        account="acct01",
        container="checkpoints",
        prefix="runs/r1",
    )
    assert parse_blob_uri(AZURE_URI).uri == AZURE_URI
    assert parse_blob_uri(AZURE_URI).blob_name("m.json") == "runs/r1/m.json"


@pytest.mark.parametrize("host", ["127.0.0.1:10000", "localhost:10000", "[::1]:10000"])
def test_parse_azurite_path_style_uri(host: str) -> None:
    location = parse_blob_uri(f"http://{host}/{DEV_ACCOUNT}/ckpt/")
    assert location.account_url == f"http://{host}/{DEV_ACCOUNT}"
    assert (location.account, location.container, location.prefix) == (DEV_ACCOUNT, "ckpt", "")
    assert location.blob_name("m.json") == "m.json"


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("/mnt/checkpoints", "not a blob URL"),
        ("ftp://acct01.blob.core.windows.net/c/p", "not a blob URL"),
        ("https://acct01.blob.core.windows.net/", "names no container"),
        ("https://example.com/ckpt/p", "no blob host"),
        ("http://acct01.blob.core.windows.net/ckpt", "need https"),
        ("http://127.0.0.1:10000/", "names no account"),
        ("https://ab.blob.core.windows.net/ckpt", "account 'ab'"),
        ("https://acct01.blob.core.windows.net/Bad_Name", "container 'Bad_Name'"),
        ("https://acct01.blob.core.windows.net/ckpt/a//b", "empty, '.' or '..'"),
        ("https://acct01.blob.core.windows.net/ckpt/../x", "empty, '.' or '..'"),
        ("https://acct01.blob.core.windows.net/ckpt/p?sv=2024&sig=abc", "query"),
    ],
)
def test_bad_uris_are_clear_value_errors(uri: str, message: str) -> None:
    with pytest.raises(ValueError, match="expected|must|need|names|has") as err:
        parse_blob_uri(uri)
    assert message in str(err.value)


# --- Credentials ----------------------------------------------------------------------------


def test_no_connection_string_means_default_azure_credential() -> None:
    credential = credential_from_env(parse_blob_uri(AZURE_URI), env={})
    assert isinstance(credential, DefaultAzureCredential)


def test_plain_http_without_connection_string_is_refused() -> None:
    location = parse_blob_uri(f"http://127.0.0.1:10000/{DEV_ACCOUNT}/ckpt")
    with pytest.raises(ValueError, match=CONNECTION_STRING_ENV):
        credential_from_env(location, env={})


def test_connection_string_key_sas_and_dev_shorthand() -> None:
    azure = parse_blob_uri(AZURE_URI)
    key = {
        CONNECTION_STRING_ENV: "DefaultEndpointsProtocol=https;AccountName=acct01;AccountKey=k=="
    }
    assert credential_from_env(azure, key) == {"account_name": "acct01", "account_key": "k=="}
    sas = {CONNECTION_STRING_ENV: "BlobEndpoint=https://x;SharedAccessSignature=sv=1&sig=a%3D"}
    assert credential_from_env(azure, sas) == "sv=1&sig=a%3D"
    dev = parse_blob_uri(f"http://127.0.0.1:10000/{DEV_ACCOUNT}/ckpt")
    shorthand = {CONNECTION_STRING_ENV: "UseDevelopmentStorage=true"}
    assert credential_from_env(dev, shorthand)["account_key"] == DEV_ACCOUNT_KEY


@pytest.mark.parametrize(
    ("connection_string", "message"),
    [
        ("AccountName=other;AccountKey=k==", "for account 'other'"),
        ("AccountName=acct01", "neither AccountName"),
        ("AccountName=acct01;garbage", "without '='"),
    ],
)
def test_bad_connection_strings_are_clear(connection_string: str, message: str) -> None:
    with pytest.raises(ValueError, match=CONNECTION_STRING_ENV) as err:
        credential_from_env(parse_blob_uri(AZURE_URI), {CONNECTION_STRING_ENV: connection_string})
    assert message in str(err.value)


@pytest.mark.parametrize(
    "options",
    [
        {"retries": -1},
        {"connect_timeout_s": 0},
        {"max_single_put_bytes": 0},
        {"max_single_get_bytes": 0},
    ],
)
def test_bad_store_options_are_rejected(options: dict[str, float]) -> None:
    key = {"account_name": "acct01", "account_key": "a2V5"}
    with pytest.raises(ValueError, match=next(iter(options))):
        BlobStore(parse_blob_uri(AZURE_URI), key, **options)


# --- The receipt and the timeouts an eviction's commit relies on ------------------------------


def test_put_returns_the_size_the_store_holds(object_store: ObjectStore, tmp_path: Path) -> None:
    assert object_store.put("a.pt", b"12345") == 5
    source = tmp_path / "state.bin"
    source.write_bytes(os.urandom(70_000))
    assert object_store.put("b.pt", source) == 70_000  # a local file, streamed
    assert object_store.get("b.pt") == source.read_bytes()


@pytest.mark.parametrize("size", [100, 5000])
def test_bytes_damaged_on_the_way_are_refused_by_the_service(
    azurite: str, blob_container_uri: str, monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    # Every upload request carries the Content-MD5 of the bytes it was given; the service
    # checks it before it keeps them (single Put Blob, and each block of a block list).
    monkeypatch.setenv(CONNECTION_STRING_ENV, azurite)
    store = BlobStore.from_uri(f"{blob_container_uri}/ckpt", max_single_put_bytes=1024)
    upload = store._container.upload_blob

    def damage(request: Any) -> None:
        body = request.http_request.data
        if isinstance(body, bytes | bytearray) and len(body) > 10:
            request.http_request.data = b"X" + bytes(body[1:])  # after the MD5 was taken

    def damaged_upload(*args: Any, **kwargs: Any) -> Any:
        return upload(*args, raw_request_hook=damage, **kwargs)

    monkeypatch.setattr(store._container, "upload_blob", damaged_upload)
    with pytest.raises(OSError, match="Azure Blob error 400"):
        store.put("torn.pt", os.urandom(size))
    with pytest.raises(FileNotFoundError):
        store.get("torn.pt")


@pytest.fixture
def silent_endpoint() -> Iterator[int]:
    """A loopback port that accepts connections and never answers: a store that hangs."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            with suppress(OSError):
                accepted.append(server.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        thread.join(5)
        for conn in accepted:
            conn.close()
        server.close()


def _silent_store(port: int, monkeypatch: pytest.MonkeyPatch, **options: Any) -> BlobStore:
    monkeypatch.setenv(CONNECTION_STRING_ENV, f"AccountName={DEV_ACCOUNT};AccountKey=a2V5")
    return BlobStore.from_uri(f"http://127.0.0.1:{port}/{DEV_ACCOUNT}/ckpt/run", **options)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "call",
    [
        lambda s: s.get("a.pt"),
        lambda s: s.put("a.pt", b"x"),
        lambda s: s.put_new("m.json", b"x"),
        lambda s: s.delete("a.pt"),
        lambda s: s.list_modified(""),
        lambda s: s.size("a.pt"),
    ],
    ids=["get", "put", "put_new", "delete", "list", "size"],
)
def test_within_a_deadline_every_call_to_a_hanging_store_times_out(
    silent_endpoint: int, monkeypatch: pytest.MonkeyPatch, call: Any
) -> None:
    # Unbounded, each call would wait the client's read timeout (15 s) on each of 4 attempts.
    store = _silent_store(silent_endpoint, monkeypatch).bounded(Deadline.after(1.0))
    with pytest.raises(TimeoutError, match="did not answer in time|no time left"):
        call(store)


@pytest.mark.timeout(60)
def test_without_a_deadline_a_read_still_times_out(
    silent_endpoint: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The SDK's default is 60 s per read: longer than the eviction notice.
    store = _silent_store(silent_endpoint, monkeypatch, read_timeout_s=0.5, retries=0)
    with pytest.raises(TimeoutError, match="did not answer in time"):
        store.get("a.pt")


def test_per_call_timeouts_fit_the_time_left() -> None:
    now = [100.0]
    store = BlobStore(parse_blob_uri(AZURE_URI), {"account_name": "acct01", "account_key": "a2V5"})
    bounded = store.bounded(Deadline(110.0, lambda: now[0]))
    assert bounded._call_options() == {
        "timeout": 10,
        "connection_timeout": 5.0,
        "read_timeout": 10.0,
        "retry_total": 3,
    }
    now[0] = 108.5  # too little time left for a retry's backoff
    assert bounded._call_options() == {
        "timeout": 2,
        "connection_timeout": 1.5,
        "read_timeout": 1.5,
        "retry_total": 0,
    }
    assert store._call_options() == {}  # unbounded: the client's own settings
    now[0] = 111.0
    with pytest.raises(TimeoutError, match="no time left"):
        bounded._call_options()
