"""``lab data upload``: a directory into the stack's data container, its marker last, as the
workers then copy it (Azurite as the container, a fake ``pulumi`` printing the stack's
outputs); and where the stack's outputs say its storage is."""

from __future__ import annotations

from pathlib import Path

import pytest
from azure.storage.blob import ContainerClient

from lab.azure.stack_outputs import StackOutputsError, checkpoint_uri, data_uri
from lab.cli import main
from tests.support.lab_azure_fixtures import fake_pulumi
from training.data.dataset_marker import MARKER, parse_marker
from training.data.fetch_data import fetch_dataset

FILES = {"points.pt": b"x" * 5000, "extra/deep/labels.txt": b"a\nb\n", "empty.bin": b""}


@pytest.fixture
def data_container(azurite: str) -> ContainerClient:
    """The stack's ``data`` container, which `pulumi up` creates."""
    container = ContainerClient.from_connection_string(azurite, "data")
    if not container.exists():
        container.create_container()
    return container


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    root = tmp_path / "mydata"
    for path, data in FILES.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(data)
    return root


def test_an_upload_to_the_stacks_container_is_what_the_workers_copy(
    azurite: str, azurite_account: str, data_container: ContainerClient, dataset: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite)
    fake_pulumi(tmp_path / "bin", {"dataUri": f"{azurite_account}/data"})
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    assert main(["data", "upload", "--stack", "dev", str(dataset)]) == 0
    out, err = capsys.readouterr()
    assert "100%" in err and "file 3/3" in err
    listed = parse_marker(data_container.download_blob(MARKER).readall(), MARKER)
    assert listed is not None and sorted(listed) == sorted(FILES)
    assert listed["points.pt"].size == 5000 and listed["points.pt"].sha256
    fetch_dataset(f"{azurite_account}/data", tmp_path / "local")
    assert {p: (tmp_path / "local" / p).read_bytes() for p in FILES} == FILES

    # Again, one file changed: only it and the marker go up.
    (dataset / "extra/deep/labels.txt").write_bytes(b"c\n")
    sent: list[str] = []
    real = ContainerClient.upload_blob

    def counted(self: ContainerClient, name: str, *args: object, **kwargs: object) -> object:
        sent.append(name)
        return real(self, name, *args, **kwargs)

    monkeypatch.setattr(ContainerClient, "upload_blob", counted)
    assert main(["data", "upload", "--stack", "dev", str(dataset)]) == 0
    assert sent == ["extra/deep/labels.txt", MARKER]

    # Every file changed, the upload cut off at the third: the marker is gone, and the next
    # upload sends only the third and the marker.
    for path in FILES:
        (dataset / path).write_bytes(b"v3 " + FILES[path])

    def cut_off(self: ContainerClient, name: str, *args: object, **kwargs: object) -> object:
        if name == "points.pt":
            raise ConnectionError("the network went")
        return counted(self, name, *args, **kwargs)

    monkeypatch.setattr(ContainerClient, "upload_blob", cut_off)
    sent.clear()
    assert main(["data", "upload", "--stack", "dev", str(dataset)]) == 1
    assert sent == ["empty.bin", "extra/deep/labels.txt"]
    assert not data_container.get_blob_client(MARKER).exists()  # the workers wait
    monkeypatch.setattr(ContainerClient, "upload_blob", counted)
    sent.clear()
    assert main(["data", "upload", "--stack", "dev", str(dataset)]) == 0
    assert sent == ["points.pt", MARKER]
    fetch_dataset(f"{azurite_account}/data", tmp_path / "again")
    assert (tmp_path / "again" / "points.pt").read_bytes() == b"v3 " + FILES["points.pt"]


def test_an_upload_under_a_prefix_and_a_refusal(
    azurite: str, azurite_account: str, data_container: ContainerClient, dataset: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite)
    uri = f"{azurite_account}/data"
    assert main(["data", "upload", "--container-uri", uri, "--prefix", "v2", str(dataset)]) == 0
    fetch_dataset(f"{uri}/v2", tmp_path / "local")
    assert (tmp_path / "local" / "points.pt").read_bytes() == FILES["points.pt"]
    wrong_key = azurite.replace("AccountKey=", "AccountKey=AAAA")
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", wrong_key)
    capsys.readouterr()
    assert main(["data", "upload", "--container-uri", uri, str(dataset)]) == 1
    assert "refused" in capsys.readouterr().err


@pytest.mark.usefixtures("processes")  # the fake pulumi
def test_a_bad_directory_or_no_stack_is_bad_input(
    dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    assert main(["data", "upload", "--container-uri", "x", str(tmp_path / "none")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    fake_pulumi(tmp_path / "bin", {})
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    assert main(["data", "upload", "--stack", "dev", str(dataset)]) == 2
    assert "has no outputs: run `pulumi up` first" in capsys.readouterr().err


def test_the_stacks_outputs_name_its_data_and_checkpoints() -> None:
    outputs = {
        "dataUri": "https://labst1.blob.core.windows.net/data/points/v2",
        "checkpointUri": "https://labst1.blob.core.windows.net/checkpoints/lab-train",
    }
    assert data_uri(outputs, "dev") == "https://labst1.blob.core.windows.net/data/points/v2"
    assert checkpoint_uri(outputs, "dev") == (
        "https://labst1.blob.core.windows.net/checkpoints/lab-train"
    )
    with pytest.raises(StackOutputsError, match="lack checkpointUri"):
        checkpoint_uri({"blobEndpoint": "https://x"}, "dev")
