"""CIFAR-10 binary data: synthetic round trip, every error case, augmentation, the CLI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from training.data.cifar10 import (
    CIFAR_MEAN,
    CIFAR_STD,
    RECORD_BYTES,
    DatasetError,
    ImageDataset,
    batch_tensors,
    counter_hash,
    load_cifar10_binary,
    main,
    write_synthetic_cifar10,
)

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cifar")
    write_synthetic_cifar10(out, train_records=100, test_records=20, seed=1, train_files=3)
    return out


def _file_bytes(ds: ImageDataset) -> bytes:
    """The dataset serialised back into records: label byte, then the 3072 pixel bytes."""
    records = torch.cat([ds.labels.to(torch.uint8)[:, None], ds.images.reshape(len(ds), -1)], 1)
    return records.numpy().tobytes()


def test_synthetic_round_trip_is_exact(data_dir: Path) -> None:
    train = load_cifar10_binary(data_dir, "train")
    test = load_cifar10_binary(data_dir, split="test")
    files = [data_dir / f"data_batch_{n}.bin" for n in (1, 2, 3)]
    assert [f.stat().st_size // RECORD_BYTES for f in files] == [34, 33, 33]
    assert _file_bytes(train) == b"".join(f.read_bytes() for f in files)
    assert _file_bytes(test) == (data_dir / "test_batch.bin").read_bytes()
    assert (len(train), len(test)) == (100, 20)
    assert train.images.dtype == torch.uint8 and train.labels.dtype == torch.int64
    assert set(train.labels.tolist()) <= set(range(10))
    assert len(set(train.labels.tolist())) >= 8  # labels spread over the classes


def test_synthetic_bytes_depend_only_on_the_seed(tmp_path: Path) -> None:
    def written(name: str, seed: int) -> list[bytes]:
        paths = write_synthetic_cifar10(
            tmp_path / name, train_records=30, test_records=5, seed=seed, train_files=2
        )
        return [p.read_bytes() for p in paths]

    assert written("a", 5) == written("b", 5)
    assert written("a", 5)[0] != written("c", 6)[0]


def test_synthetic_test_split_does_not_repeat_training_images(data_dir: Path) -> None:
    train = load_cifar10_binary(data_dir)
    test = load_cifar10_binary(data_dir, "test")
    train_rows = {bytes(row) for row in train.images.reshape(len(train), -1).numpy()}
    assert not any(bytes(row) in train_rows for row in test.images.reshape(len(test), -1).numpy())


def test_train_files_are_read_in_numeric_order(tmp_path: Path) -> None:
    # Eleven files: a lexical sort would read data_batch_10 and _11 before data_batch_2.
    paths = write_synthetic_cifar10(tmp_path, train_records=22, test_records=1, train_files=11)
    expected = b"".join(tmp_path.joinpath(f"data_batch_{n}.bin").read_bytes() for n in range(1, 12))
    assert len(paths) == 12
    assert _file_bytes(load_cifar10_binary(tmp_path)) == expected


def test_missing_directory_says_how_to_make_one(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="does not exist") as err:
        load_cifar10_binary(tmp_path / "nowhere")
    assert "python -m training.data.cifar10 --out" in str(err.value)


def test_directory_without_batch_files_lists_what_is_there(tmp_path: Path) -> None:
    (tmp_path / "readme.html").write_text("CIFAR")
    (tmp_path / "data_batch_1").write_bytes(b"x")  # no .bin suffix: not a batch file
    with pytest.raises(DatasetError, match="no train batch files") as err:
        load_cifar10_binary(tmp_path)
    assert "data_batch_1, readme.html" in str(err.value)
    with pytest.raises(DatasetError, match="no test batch files \\(test_batch.bin\\)"):
        load_cifar10_binary(tmp_path, "test")


def _copy(data_dir: Path, dest: Path) -> Path:
    dest.mkdir()
    for f in data_dir.iterdir():
        (dest / f.name).write_bytes(f.read_bytes())
    return dest


def test_torn_file_names_file_size_and_record_size(data_dir: Path, tmp_path: Path) -> None:
    copy = _copy(data_dir, tmp_path / "torn")
    torn = copy / "data_batch_2.bin"
    size = torn.stat().st_size - 100
    with open(torn, "r+b") as f:
        f.truncate(size)
    with pytest.raises(DatasetError) as err:
        load_cifar10_binary(copy)
    message = str(err.value)
    assert str(torn) in message and f"{size} bytes" in message
    assert f"{RECORD_BYTES}-byte record" in message and "torn" in message


def test_bad_label_names_the_record(data_dir: Path, tmp_path: Path) -> None:
    copy = _copy(data_dir, tmp_path / "bad")
    raw = bytearray((copy / "test_batch.bin").read_bytes())
    raw[7 * RECORD_BYTES] = 10
    (copy / "test_batch.bin").write_bytes(bytes(raw))
    with pytest.raises(DatasetError, match="record 7 has label 10, but CIFAR-10 labels are 0-9"):
        load_cifar10_binary(copy, "test")


def test_empty_file_and_bad_split(data_dir: Path, tmp_path: Path) -> None:
    copy = _copy(data_dir, tmp_path / "empty")
    (copy / "data_batch_3.bin").write_bytes(b"")
    with pytest.raises(DatasetError, match="data_batch_3.bin is empty"):
        load_cifar10_binary(copy)
    with pytest.raises(ValueError, match="split must be one of train, test, got 'valid'"):
        load_cifar10_binary(copy, "valid")


def test_image_dataset_checks_shapes() -> None:
    pixels, labels = torch.zeros(2, 3, 32, 32, dtype=torch.uint8), torch.zeros(2, dtype=torch.int64)
    assert len(ImageDataset(pixels, labels)) == 2
    with pytest.raises(ValueError, match="images must be uint8 of shape"):
        ImageDataset(pixels.float(), labels)
    with pytest.raises(ValueError, match="images must be uint8 of shape"):
        ImageDataset(pixels, labels[:1])
    with pytest.raises(ValueError, match="labels must be int64"):
        ImageDataset(pixels, labels.int())


def test_batch_without_augmentation_is_the_normalised_image(data_dir: Path) -> None:
    ds = load_cifar10_binary(data_dir)
    x, y = batch_tensors(ds, torch.tensor([4, 0, 9]), seed=0, epoch=0, augment=False)
    assert x.shape == (3, 3, 32, 32) and x.dtype == torch.float32
    assert torch.equal(y, ds.labels[[4, 0, 9]])
    for c in range(3):
        raw = ds.images[0, c].float() / 255
        torch.testing.assert_close(x[1, c], (raw - CIFAR_MEAN[c]) / CIFAR_STD[c])


def _candidates(image: torch.Tensor) -> list[torch.Tensor]:
    """Every flip and 4-px-padded crop of one uint8 image."""
    padded = torch.nn.functional.pad(image, (4, 4, 4, 4))
    crops = [padded[:, dy : dy + 32, dx : dx + 32] for dy in range(9) for dx in range(9)]
    return crops + [c.flip(-1) for c in crops]


def _to_uint8(x: torch.Tensor) -> torch.Tensor:
    mean = torch.tensor(CIFAR_MEAN).view(3, 1, 1)
    std = torch.tensor(CIFAR_STD).view(3, 1, 1)
    return ((x * std + mean) * 255).round().to(torch.uint8)


def test_augmentation_is_a_flip_and_crop_of_the_sample(data_dir: Path) -> None:
    ds = load_cifar10_binary(data_dir)
    x, _ = batch_tensors(ds, torch.arange(40), seed=3, epoch=1)
    changed = 0
    for i in range(40):
        got = _to_uint8(x[i])
        assert any(torch.equal(got, c) for c in _candidates(ds.images[i]))
        changed += not torch.equal(got, ds.images[i])
    assert changed >= 30  # 1 in 162 draws is the identity


def test_augmentation_does_not_depend_on_the_batch(data_dir: Path) -> None:
    ds = load_cifar10_binary(data_dir)
    order = torch.tensor([57, 3, 99, 12, 3, 41, 0, 76])
    together, labels = batch_tensors(ds, order, seed=11, epoch=4)
    for pos, index in enumerate(order.tolist()):
        alone, label = batch_tensors(ds, torch.tensor([index]), seed=11, epoch=4)
        assert torch.equal(alone[0], together[pos])
        assert label.item() == labels[pos].item()
    # Split across "ranks" in another order: still the same per-sample result.
    reversed_x, _ = batch_tensors(ds, order.flip(0), seed=11, epoch=4)
    assert torch.equal(reversed_x.flip(0), together)
    # Another epoch or seed draws anew.
    assert not torch.equal(batch_tensors(ds, order, seed=11, epoch=5)[0], together)
    assert not torch.equal(batch_tensors(ds, order, seed=12, epoch=4)[0], together)


def test_counter_hash_is_keyed_by_every_input() -> None:
    counters = np.arange(1000)
    base = counter_hash((1, 2, 3), counters)
    assert np.array_equal(base, counter_hash((1, 2, 3), counters))
    assert np.unique(base).size == 1000
    for other in ((1, 2, 4), (1, 3, 2), (2, 2, 3)):
        assert not np.any(base == counter_hash(other, counters))
    assert np.mean(base & np.uint64(1)) == pytest.approx(0.5, abs=0.06)


@pytest.mark.usefixtures("processes")
def test_cli_writes_a_loadable_dataset(tmp_path: Path) -> None:
    out = tmp_path / "cli"
    result = subprocess.run(
        [sys.executable, "-m", "training.data.cifar10", "--out", str(out), "--train-records", "50",
         "--test-records", "10", "--seed", "2"],
        cwd=REPO, capture_output=True, text=True, check=False, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "data_batch_5.bin (10 records)" in result.stderr
    assert len(load_cifar10_binary(out)) == 50
    expected = write_synthetic_cifar10(tmp_path / "api", train_records=50, test_records=10, seed=2)
    assert (out / "test_batch.bin").read_bytes() == expected[-1].read_bytes()


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--train-records", "3"], "--train-records must be an integer >= 5, got 3"),
        (["--test-records", "0"], "--test-records must be an integer >= 1, got 0"),
        (["--train-files", "0"], "--train-files must be an integer >= 1, got 0"),
        (["--seed", "x"], "argument --seed: invalid int value: 'x'"),
    ],
)
def test_cli_rejects_bad_flags(
    argv: list[str], needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--out", str(tmp_path / "out"), *argv])
    assert exit_info.value.code == 2
    assert needle in capsys.readouterr().err


def test_cli_rejects_an_out_path_that_is_a_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as exit_info:
        main(["--out", str(tmp_path / "file")])
    assert exit_info.value.code == 2
    assert f"--out {tmp_path / 'file'}" in capsys.readouterr().err
