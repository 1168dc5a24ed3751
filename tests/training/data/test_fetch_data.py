"""The workers copy the dataset to node-local disk before they join: every file under the data
source (nested too), once its marker says the upload is whole, streamed, verified, resumed; on
the cluster from the read-only Blob CSI mount (a directory), elsewhere from Blob Storage."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from training import agent
from training.data.blob_source import BlobSource
from training.data.dataset_marker import MARKER, local_file, marker_body
from training.data.fetch_data import COPIED, DataFetchError, MountedDirectory, fetch_dataset
from training.data.streams import open_stream, write_stream
from training.elastic.exit_codes import BAD_INPUT, RETRY_ME
from training.elastic.launch import DATA_DIR_ENV, DATA_URI_ENV

FILES = {
    "points.pt": b"p" * 3000,
    "extra/labels/train.txt": b"line\n" * 700,
    "notes.md": b"",
}


def _write_tree(root: Path, files: dict[str, bytes] = FILES, marker: bool = True) -> None:
    for path, data in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(data)
    if marker:
        listed = [local_file(root, root / path) for path in files]
        (root / MARKER).write_bytes(marker_body(listed, source="test"))


def _copied(local: Path) -> dict[str, bytes]:
    return {p: (local / p).read_bytes() for p in FILES}


@pytest.fixture
def mount(tmp_path: Path) -> Iterator[Path]:
    """A directory as blobfuse2 shows the data container: nested files and the marker."""
    root = tmp_path / "mnt" / "dataset"
    root.mkdir(parents=True)
    _write_tree(root)
    yield root


# ---- from the read-only mount (the cluster's path) ----------------------------------------------


def test_every_file_nested_too_is_copied_and_verified(mount: Path, tmp_path: Path) -> None:
    files = fetch_dataset(str(mount), tmp_path / "local")
    assert sorted(p.relative_to(tmp_path / "local").as_posix() for p in files) == sorted(FILES)
    assert _copied(tmp_path / "local") == FILES
    assert not (tmp_path / "local" / MARKER).exists()
    assert json.loads((tmp_path / "local" / COPIED).read_text())["bytes"] == 3000 + 3500


def test_a_restarted_container_reads_nothing_again(
    mount: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fetch_dataset(str(mount), tmp_path / "local")

    def no_read(self: MountedDirectory, path: str, offset: int) -> Iterator[bytes]:
        raise AssertionError(f"read {path} again")

    monkeypatch.setattr(MountedDirectory, "chunks", no_read)
    assert len(fetch_dataset(str(mount), tmp_path / "local")) == len(FILES)


class Killed(BaseException):
    """The container's end mid-copy: nothing of the copy's own runs after it."""


def test_a_copy_killed_halfway_copies_only_the_rest_when_it_starts_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = tmp_path / "mnt"
    files = {f"shard-{i}.bin": bytes([i]) * 10_000 for i in range(4)}
    _write_tree(source, files)
    monkeypatch.setattr("training.data.fetch_data.CHUNK_BYTES", 1000)
    monkeypatch.setattr("training.data.dataset_marker.CHUNK_BYTES", 1000)
    real = MountedDirectory.chunks
    read: list[tuple[str, int]] = []

    def counted(self: MountedDirectory, path: str, offset: int) -> Iterator[bytes]:
        for chunk in real(self, path, offset):
            if len(read) == 25:  # two files and half of the third: the container dies
                raise Killed
            read.append((path, len(chunk)))
            yield chunk

    monkeypatch.setattr(MountedDirectory, "chunks", counted)
    with pytest.raises(Killed):
        fetch_dataset(str(source), tmp_path / "local")
    assert sum(n for _, n in read) == 25_000
    read.clear()
    fetch_dataset(str(source), tmp_path / "local")
    # Only what was left: the third file's second half and the fourth file.
    assert sum(n for p, n in read if p == "shard-2.bin") == 5_000
    assert sum(n for _, n in read) == 15_000
    assert {p for p, _ in read} == {"shard-2.bin", "shard-3.bin"}
    assert {p: (tmp_path / "local" / p).read_bytes() for p in files} == files


def test_the_copy_waits_for_the_marker_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "mnt"
    source.mkdir()
    _write_tree(source, marker=False)
    polls: list[float] = []

    def upload_finishes(seconds: float) -> None:
        polls.append(seconds)
        if len(polls) == 2:  # `lab data upload` writes the marker last
            (source / MARKER).write_text("{}")

    fetch_dataset(str(source), tmp_path / "local", poll_s=5, sleep=upload_finishes)
    assert polls == [5, 5]
    waits = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["event"] for r in waits] == ["data_waiting", "data_waiting", "data_copied"]
    assert MARKER in waits[0]["why"] and "lab data upload" in waits[0]["hint"]
    assert _copied(tmp_path / "local") == FILES  # a marker that lists nothing: every file


def test_a_marker_listing_files_not_there_yet_waits_too(tmp_path: Path) -> None:
    source = tmp_path / "mnt"
    source.mkdir()
    _write_tree(source)
    (source / "points.pt").unlink()
    with pytest.raises(DataFetchError, match=r"1 of the 3 files .* not there yet \(points.pt\)"):
        fetch_dataset(str(source), tmp_path / "local", wait_s=0)


def test_a_file_that_does_not_match_its_marker_is_refused(mount: Path, tmp_path: Path) -> None:
    (mount / "points.pt").write_bytes(b"q" * 3000)  # same size, other bytes
    with pytest.raises(DataFetchError, match="points.pt: read 3000 bytes .* data changed"):
        fetch_dataset(str(mount), tmp_path / "local")
    assert not (tmp_path / "local" / "points.pt").exists()


def test_a_stream_of_shards_in_a_folder_reads_from_the_copy(tmp_path: Path) -> None:
    source = tmp_path / "mnt"
    written = write_stream(source / "points", "points", "1", [[[1, 2]], [[3, 4], [5, 6]]])
    (source / MARKER).write_text("{}")
    fetch_dataset(str(source), tmp_path / "local")
    stream = open_stream(tmp_path / "local" / "points")
    assert stream.identity == written.identity and list(stream.read(1)) == [[3, 4], [5, 6]]


def test_a_mount_the_identity_may_not_read_is_retried_then_names_the_role(
    mount: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # blobfuse2 answers EACCES when the token's identity lost its role on the container.
    def refused(self: MountedDirectory) -> bytes:
        raise PermissionError(13, "Permission denied", str(self.root))

    monkeypatch.setattr(MountedDirectory, "marker", refused)
    with pytest.raises(DataFetchError, match="Storage Blob Data Reader on the data container"):
        fetch_dataset(str(mount), tmp_path / "local", role_wait_s=0, sleep=lambda s: None)


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
    def disconnected(self: MountedDirectory) -> bytes:
        raise OSError(107, "Transport endpoint is not connected", str(self.root))

    monkeypatch.setattr(MountedDirectory, "marker", disconnected)
    env = {DATA_URI_ENV: str(mount), DATA_DIR_ENV: str(tmp_path / "local")}
    assert _agent(env) == (RETRY_ME, [])


def test_the_agent_copies_from_the_mount_before_it_launches(mount: Path, tmp_path: Path) -> None:
    code, launched = _agent({DATA_URI_ENV: str(mount), DATA_DIR_ENV: str(tmp_path / "local")})
    assert code == 0 and len(launched) == 1
    assert (tmp_path / "local" / COPIED).exists()


def _agent(env: dict[str, str]) -> tuple[int, list[list[str]]]:
    launched: list[list[str]] = []
    code = agent.main(
        ["--module", "training.train"],
        env={"TRAIN_LAUNCHER": "torchrun", **env},
        execv=lambda path, argv: launched.append(argv),
    )
    return code, launched


def test_a_data_uri_without_a_directory_is_bad_input(tmp_path: Path) -> None:
    assert _agent({DATA_URI_ENV: "https://a.blob.core.windows.net/data"}) == (BAD_INPUT, [])


# ---- from Blob Storage (Azurite) ----------------------------------------------------------------


@pytest.fixture
def data_uri(
    azurite: str, blob_container_uri: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> str:
    """A container prefix holding nested files and their marker, as `lab data upload` leaves."""
    from azure.storage.blob import ContainerClient

    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite)
    source = tmp_path / "source"
    _write_tree(source)
    client = ContainerClient.from_connection_string(azurite, blob_container_uri.rsplit("/", 1)[1])
    client.create_container()
    for path in [*FILES, MARKER]:
        client.upload_blob(f"mine/{path}", (source / path).read_bytes())
    return f"{blob_container_uri}/mine"


def test_the_files_under_a_blob_prefix_are_copied_once(
    data_uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fetch_dataset(data_uri, tmp_path / "local")
    assert _copied(tmp_path / "local") == FILES

    def no_read(self: BlobSource, path: str, offset: int) -> Iterator[bytes]:
        raise AssertionError(f"downloaded {path} again")

    monkeypatch.setattr(BlobSource, "chunks", no_read)
    assert len(fetch_dataset(data_uri, tmp_path / "local")) == len(FILES)


def test_the_agent_waits_on_an_empty_container_then_an_unreachable_store_asks_for_a_pod(
    azurite: str, blob_container_uri: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
    unused_loopback_port: int,
) -> None:  # fmt: skip
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite)
    with pytest.raises(DataFetchError, match=f"no {MARKER} in .* yet"):
        fetch_dataset(f"{blob_container_uri}/x", tmp_path / "local", wait_s=0)
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", "UseDevelopmentStorage=true")
    uri = f"http://127.0.0.1:{unused_loopback_port}/devstoreaccount1/data/x"
    assert _agent({DATA_URI_ENV: uri, DATA_DIR_ENV: str(tmp_path / "d")}) == (RETRY_ME, [])
