"""Data staging: a real archive served on loopback, real Azurite, the checks before any upload."""

from __future__ import annotations

import hashlib
import http.server
import io
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from azure.storage.blob import ContainerClient

from training.checkpoints.blob_store import CONNECTION_STRING_ENV
from training.data.cifar10 import load_cifar10_binary, write_synthetic_cifar10
from training.data.fetch_data import fetch_dataset
from training.data.stage_data import MARKER, main, parse_checksum


def _archive(tmp_path: Path, *, with_test: bool = True, torn: bool = False) -> bytes:
    """A CIFAR-10-shaped .tar.gz: cifar-10-batches-bin/<batch files>, like the official one."""
    files = write_synthetic_cifar10(tmp_path / "src", train_records=60, test_records=20)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for path in files:
            if path.name == "test_batch.bin" and not with_test:
                continue
            data = path.read_bytes()[:-1] if torn and path.name == "data_batch_1.bin" else None
            if data is None:
                tar.add(path, arcname=f"cifar-10-batches-bin/{path.name}")
            else:
                info = tarfile.TarInfo(f"cifar-10-batches-bin/{path.name}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        readme = tarfile.TarInfo("cifar-10-batches-bin/readme.html")
        readme.size = 2
        tar.addfile(readme, io.BytesIO(b"hi"))
    return buffer.getvalue()


class _Server:
    """Serves one body at /archive.tar.gz on loopback and counts the downloads."""

    def __init__(self) -> None:
        self.body = b""
        self.hits = 0
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                owner.hits += 1
                if self.path != "/archive.tar.gz":
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(owner.body)))
                self.end_headers()
                self.wfile.write(owner.body)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/archive.tar.gz"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


@pytest.fixture
def server() -> Iterator[_Server]:
    srv = _Server()
    yield srv
    srv.httpd.shutdown()


@pytest.fixture
def container(
    azurite: str, blob_container_uri: str, monkeypatch: pytest.MonkeyPatch
) -> tuple[str, ContainerClient]:
    monkeypatch.setenv(CONNECTION_STRING_ENV, azurite)
    client = ContainerClient.from_connection_string(azurite, blob_container_uri.rsplit("/", 1)[1])
    client.create_container()
    return blob_container_uri, client


def _md5(body: bytes) -> str:
    return "md5:" + hashlib.md5(body).hexdigest()


def test_stages_the_batches_once_and_they_load(
    tmp_path: Path, server: _Server, container: tuple[str, ContainerClient]
) -> None:
    uri, client = container
    server.body = _archive(tmp_path)
    args = ["--source", server.url, "--checksum", _md5(server.body), "--container-uri", uri]
    assert main(args) == 0
    names = sorted(b.name for b in client.list_blobs())
    assert names == [MARKER, *[f"data_batch_{i}.bin" for i in range(1, 6)], "test_batch.bin"]
    # The workers' copy takes the marker as staging's end, checks every file against it, and
    # what it copied is the dataset the archive held.
    local = tmp_path / "fetched"
    fetch_dataset(uri, local)
    assert len(load_cifar10_binary(local, "train")) == 60
    assert len(load_cifar10_binary(local, "test")) == 20
    # A second pulumi up with the same checksum downloads nothing.
    assert main(args) == 0
    assert server.hits == 1


def test_a_checksum_mismatch_uploads_nothing_and_is_permanent(
    tmp_path: Path, server: _Server, container: tuple[str, ContainerClient], capsys: object
) -> None:
    uri, client = container
    server.body = _archive(tmp_path)
    wrong = "sha256:" + "0" * 64
    assert main(["--source", server.url, "--checksum", wrong, "--container-uri", uri]) == 2
    assert list(client.list_blobs()) == []
    err = capsys.readouterr().err  # type: ignore[attr-defined]
    assert "but the config expects" in err and "dataSourceChecksum" in err


@pytest.mark.parametrize(
    ("kind", "message"),
    [("no-test", "CIFAR-10's binary version has"), ("torn", "not CIFAR-10 binary")],
)
def test_an_archive_that_is_not_cifar10_binary_uploads_nothing(
    tmp_path: Path,
    server: _Server,
    container: tuple[str, ContainerClient],
    capsys: pytest.CaptureFixture[str],
    kind: str,
    message: str,
) -> None:
    uri, client = container
    server.body = _archive(tmp_path, with_test=kind != "no-test", torn=kind == "torn")
    code = main(["--source", server.url, "--checksum", _md5(server.body), "--container-uri", uri])
    assert code == 2
    assert list(client.list_blobs()) == []
    assert message in capsys.readouterr().err


def test_a_missing_archive_is_permanent_and_a_dead_server_is_retried(
    server: _Server, container: tuple[str, ContainerClient], capsys: pytest.CaptureFixture[str]
) -> None:
    uri, _ = container
    missing = server.url.replace("archive", "nothing")
    assert main(["--source", missing, "--checksum", "md5:" + "0" * 32, "--container-uri", uri]) == 2
    assert "HTTP 404" in capsys.readouterr().err
    server.httpd.shutdown()
    server.httpd.server_close()
    assert (
        main(["--source", server.url, "--checksum", "md5:" + "0" * 32, "--container-uri", uri]) == 1
    )


@pytest.mark.parametrize(
    "text", ["c32a1d4ab5d03f1284b67883e8d87530", "md5:xyz", "sha1:" + "a" * 40]
)
def test_checksum_syntax_is_checked_before_any_io(
    text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--source", "http://127.0.0.1:9/x", "--checksum", text]
    assert main([*args, "--container-uri", "http://127.0.0.1:9/devstoreaccount1/data"]) == 2
    assert "checksum must be md5:<32 hex digits> or sha256:<64 hex digits>" in (
        capsys.readouterr().err
    )


def test_checksum_is_case_insensitive() -> None:
    assert parse_checksum(" MD5:C32A1D4AB5D03F1284B67883E8D87530 ") == (
        "md5",
        "c32a1d4ab5d03f1284b67883e8d87530",
    )


def test_a_text_corpus_is_staged_as_input_txt_and_the_task_reads_it(
    tmp_path: Path, server: _Server, container: tuple[str, ContainerClient]
) -> None:
    from training.data.sources import CORPUS_FILE

    uri, client = container
    server.body = b"First Citizen:\nBefore we proceed any further, hear me speak.\n" * 40
    checksum = "sha256:" + hashlib.sha256(server.body).hexdigest()
    args = ["--source", server.url, "--checksum", checksum, "--container-uri", uri]
    assert main([*args, "--format", "text"]) == 0
    assert sorted(b.name for b in client.list_blobs()) == [MARKER, CORPUS_FILE]
    assert client.download_blob(CORPUS_FILE).readall() == server.body
    assert main([*args, "--format", "text"]) == 0 and server.hits == 1  # staged once


def test_a_corpus_that_is_not_utf8_text_uploads_nothing(
    tmp_path: Path, server: _Server, container: tuple[str, ContainerClient], capsys: object
) -> None:
    uri, client = container
    server.body = _archive(tmp_path)  # an archive where a text file was expected
    args = ["--source", server.url, "--checksum", _md5(server.body), "--container-uri", uri]
    assert main([*args, "--format", "text"]) == 2
    assert list(client.list_blobs()) == []
    assert "is not UTF-8 text" in capsys.readouterr().err  # type: ignore[attr-defined]
