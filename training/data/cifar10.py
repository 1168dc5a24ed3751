"""CIFAR-10 in its binary format: parse it, write a learnable synthetic copy, augment a batch.

Records are parsed as bytes and never unpickled: the data sits on shared storage, and a
pickle is code. Augmentation is keyed by (seed, epoch, sample index) through a counter-based
hash, so a sample looks the same whichever rank or batch takes it, and the training
trajectory does not depend on the world size.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import logging
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from training.data.sampler import rank_share

log = logging.getLogger(__name__)

IMAGE_SHAPE = (3, 32, 32)
IMAGE_BYTES = 3 * 32 * 32
RECORD_BYTES = 1 + IMAGE_BYTES
"""One record: a label byte, then 3072 pixel bytes (red plane, green plane, blue plane)."""
NUM_CLASSES = 10
SPLITS = ("train", "test")
TEST_FILE = "test_batch.bin"
_TRAIN_FILE = re.compile(r"data_batch_(\d+)\.bin")

# Per-channel statistics of the real CIFAR-10 training set (the usual normalisation).
CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)
CROP_PADDING = 4

# Hash domains keep the streams apart: without them, epoch 2's flips could equal the labels.
_AUGMENT, _LABELS, _NOISE, _BRIGHTNESS, _TEMPLATES = 1, 2, 3, 4, 5
# Test records are numbered from here, so no test image repeats a training image.
_TEST_RECORD_OFFSET = 1 << 40
_MASK64 = (1 << 64) - 1
# Synthetic difficulty: a width-16 ResNet's loss falls within ~100 steps, not in the first 5.
_TEMPLATE_PERCENT = 60
_BRIGHTNESS_RANGE = 30


class DatasetError(Exception):
    """The data on disk is missing or malformed; the message names the file and the fix."""


@dataclass(frozen=True)
class ImageDataset:
    """A whole split in memory, as the raw bytes the files hold."""

    images: torch.Tensor
    """(N, 3, 32, 32) uint8, channel-major like the files."""
    labels: torch.Tensor
    """(N,) int64 class ids in 0..9."""

    def __post_init__(self) -> None:
        n = self.labels.shape[0] if self.labels.dim() == 1 else -1
        if self.images.dtype != torch.uint8 or tuple(self.images.shape) != (n, *IMAGE_SHAPE):
            raise ValueError(
                f"images must be uint8 of shape (N, 3, 32, 32) matching labels (N,), got "
                f"{self.images.dtype} {tuple(self.images.shape)} and {tuple(self.labels.shape)}"
            )
        if self.labels.dtype != torch.int64:
            raise ValueError(f"labels must be int64, got {self.labels.dtype}")

    def __len__(self) -> int:
        return self.labels.shape[0]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample ``index``: its (3, 32, 32) uint8 image and its label."""
        return self.images[index], self.labels[index]

    @functools.cached_property
    def digest(self) -> str:
        """SHA-256 of the images and labels (about 0.1 s for CIFAR-10's 150 MB): two datasets
        of one size but other content must not resume each other's state."""
        hasher = hashlib.sha256(self.images.contiguous().numpy().tobytes())
        hasher.update(self.labels.contiguous().numpy().tobytes())
        return hasher.hexdigest()


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's step on a uint64 array (array arithmetic wraps mod 2**64 silently)."""
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def counter_hash(keys: tuple[int, ...], counters: np.ndarray) -> np.ndarray:
    """64 random-looking bits per counter, a pure function of ``keys`` and the counter."""
    counters = np.atleast_1d(np.asarray(counters)).astype(np.uint64)
    h = np.zeros_like(counters)
    for key in keys:
        h = _mix(h ^ np.uint64(key & _MASK64))
    return _mix(h ^ counters)


def _read_batch_file(path: Path) -> np.ndarray:
    """The file's records as an (N, 3073) uint8 array, checked for size and labels."""
    raw = path.read_bytes()
    if not raw:
        raise DatasetError(f"{path} is empty: a CIFAR-10 batch file holds at least one record")
    if len(raw) % RECORD_BYTES:
        raise DatasetError(
            f"{path} has {len(raw)} bytes, not a multiple of the {RECORD_BYTES}-byte record "
            f"(1 label byte + {IMAGE_BYTES} pixel bytes): the file is torn or corrupt"
        )
    records = np.frombuffer(raw, dtype=np.uint8).reshape(-1, RECORD_BYTES)
    bad = np.flatnonzero(records[:, 0] >= NUM_CLASSES)
    if bad.size:
        raise DatasetError(
            f"{path}: record {bad[0]} has label {records[bad[0], 0]}, but CIFAR-10 labels are "
            f"0-{NUM_CLASSES - 1} (is this another dataset's format?)"
        )
    return records


def _split_files(root: Path, split: str) -> list[Path]:
    """The batch files of ``split`` in ``root``: data_batch_N.bin sorted by N, or the test file."""
    if split == "train":
        numbered = [
            (int(m.group(1)), p)
            for p in root.iterdir()
            if p.is_file() and (m := _TRAIN_FILE.fullmatch(p.name))
        ]
        files = [p for _, p in sorted(numbered)]
    else:
        files = [root / TEST_FILE] if (root / TEST_FILE).is_file() else []
    if not files:
        wanted = "data_batch_1.bin ... data_batch_5.bin" if split == "train" else TEST_FILE
        present = sorted(p.name for p in root.iterdir())
        raise DatasetError(
            f"no {split} batch files ({wanted}) in {root}; it holds: "
            f"{', '.join(present[:20]) or 'nothing'}{' ...' if len(present) > 20 else ''}"
        )
    return files


def _data_root(data_dir: str | Path) -> Path:
    root = Path(data_dir)
    if not root.is_dir():
        raise DatasetError(
            f"CIFAR-10 data directory {root} does not exist; use the binary version of "
            "CIFAR-10, or write a synthetic one with "
            f"`python -m training.data.cifar10 --out {root}`"
        )
    return root


def load_cifar10_binary(data_dir: str | Path, split: str = "train") -> ImageDataset:
    """Load a split of CIFAR-10's binary version: every data_batch_*.bin, or test_batch.bin."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    root = _data_root(data_dir)
    records = np.concatenate([_read_batch_file(p) for p in _split_files(root, split)])
    return ImageDataset(
        images=torch.from_numpy(records[:, 1:].reshape(-1, *IMAGE_SHAPE).copy()),
        labels=torch.from_numpy(records[:, 0].astype(np.int64)),
    )


def _class_templates(seed: int) -> np.ndarray:
    """(10, 3072) int32: each class a 4x4 grid of random colours, blown up to 32x32."""
    cells = counter_hash((_TEMPLATES, seed), np.arange(NUM_CLASSES * 3 * 4 * 4)) >> np.uint64(56)
    grid = cells.astype(np.int32).reshape(NUM_CLASSES, 3, 4, 4)
    return grid.repeat(8, axis=2).repeat(8, axis=3).reshape(NUM_CLASSES, IMAGE_BYTES)


def _synthetic_records(templates: np.ndarray, seed: int, first: int, count: int) -> np.ndarray:
    """(count, 3073) uint8 records numbered from ``first``: template + noise + brightness."""
    numbers = np.arange(first, first + count, dtype=np.uint64)
    labels = (counter_hash((_LABELS, seed), numbers) % np.uint64(NUM_CLASSES)).astype(np.int64)
    # Each 64-bit hash gives 8 noise bytes; little-endian pinned so every host writes the same.
    words = np.arange(first * IMAGE_BYTES // 8, (first + count) * IMAGE_BYTES // 8, dtype=np.uint64)
    noise = counter_hash((_NOISE, seed), words).astype("<u8").view(np.uint8)
    noise = noise.reshape(count, IMAGE_BYTES).astype(np.int32)
    shift = counter_hash((_BRIGHTNESS, seed), numbers) % np.uint64(2 * _BRIGHTNESS_RANGE + 1)
    brightness = shift.astype(np.int32) - _BRIGHTNESS_RANGE
    # Integer arithmetic only: the bytes are the same on every machine and numpy version.
    blend = templates[labels] * _TEMPLATE_PERCENT + noise * (100 - _TEMPLATE_PERCENT)
    pixels = blend // 100 + brightness[:, None]
    records = np.empty((count, RECORD_BYTES), dtype=np.uint8)
    records[:, 0] = labels
    records[:, 1:] = np.clip(pixels, 0, 255)
    return records


def _check_count(name: str, value: int, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")


def write_synthetic_cifar10(
    out_dir: str | Path,
    *,
    train_records: int = 10000,
    test_records: int = 1000,
    seed: int = 0,
    train_files: int = 5,
) -> list[Path]:
    """Write a learnable CIFAR-10 look-alike in the binary format; the bytes depend on ``seed``.

    Each class has its own colour-block template; every image is that template blended with
    per-pixel noise and shifted in brightness, so a small CNN's loss falls within a few
    hundred steps. Files are written in place (no rename): they are inputs, not checkpoints.
    """
    _check_count("train_files", train_files, 1)
    _check_count("train_records", train_records, train_files)  # no file may be empty
    _check_count("test_records", test_records, 1)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    templates = _class_templates(seed)
    paths: list[Path] = []
    for n in range(train_files):
        first, count = rank_share(train_records, train_files, n)
        paths.append(out / f"data_batch_{n + 1}.bin")
        paths[-1].write_bytes(_synthetic_records(templates, seed, first, count).tobytes())
    paths.append(out / TEST_FILE)
    test = _synthetic_records(templates, seed, _TEST_RECORD_OFFSET, test_records)
    paths[-1].write_bytes(test.tobytes())
    return paths


def _flip_and_crop(images: torch.Tensor, bits: np.ndarray) -> torch.Tensor:
    """Per-sample horizontal flip and 4-px-padded random crop, both read from ``bits``."""
    size = IMAGE_SHAPE[-1]
    span = np.uint64(2 * CROP_PADDING + 1)
    flip = torch.from_numpy((bits & np.uint64(1)).astype(np.bool_))
    dy = torch.from_numpy(((bits >> np.uint64(8)) % span).astype(np.int64))
    dx = torch.from_numpy(((bits >> np.uint64(24)) % span).astype(np.int64))
    padded = F.pad(images, (CROP_PADDING,) * 4)
    ar = torch.arange(size)
    rows = dy[:, None] + ar
    cols = torch.where(flip[:, None], dx[:, None] + (size - 1) - ar, dx[:, None] + ar)
    batch = torch.arange(images.shape[0])[:, None, None]
    # Advanced indices split by a slice put the channel last: (B, 32, 32, 3).
    return padded[batch, :, rows[:, :, None], cols[:, None, :]].permute(0, 3, 1, 2)


def batch_tensors(
    ds: ImageDataset, indices: torch.Tensor, *, seed: int, epoch: int, augment: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 normalised images and int64 labels for ``indices``.

    With ``augment``, each sample is flipped and cropped by a hash of (seed, epoch, sample
    index), never by an RNG: the result for a sample is the same in any batch, on any rank.
    """
    if indices.dim() != 1:
        raise ValueError(f"indices must be 1-D, got shape {tuple(indices.shape)}")
    idx = indices.to(torch.int64)
    return normalised_batch(ds.images[idx], ds.labels[idx], idx, seed, epoch, augment)


def normalised_batch(
    images: torch.Tensor,
    labels: torch.Tensor,
    indices: torch.Tensor,
    seed: int,
    epoch: int,
    augment: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_tensors`` of images already gathered: ``indices`` are their sample indices,
    which key the augmentation."""
    if augment:
        images = _flip_and_crop(images, counter_hash((_AUGMENT, seed, epoch), indices.numpy()))
    mean = torch.tensor(CIFAR_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(CIFAR_STD).view(1, 3, 1, 1)
    x = (images.to(torch.float32) / 255.0 - mean) / std
    return x.contiguous(), labels


def main(argv: list[str] | None = None) -> int:
    """CLI: write a synthetic CIFAR-10 to ``--out``."""
    parser = argparse.ArgumentParser(
        prog="python -m training.data.cifar10",
        description="Write a synthetic, learnable CIFAR-10 in the binary format.",
    )
    parser.add_argument("--out", required=True, type=Path, help="directory to write into")
    parser.add_argument("--train-records", type=int, default=10000)
    parser.add_argument("--test-records", type=int, default=1000)
    parser.add_argument("--train-files", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        paths = write_synthetic_cifar10(
            args.out,
            train_records=args.train_records,
            test_records=args.test_records,
            seed=args.seed,
            train_files=args.train_files,
        )
    except ValueError as e:
        parser.error(f"--{str(e).replace('_', '-')}")  # exits 2; the message names the flag
    except OSError as e:
        parser.error(f"--out {args.out}: {e.strerror or e}")
    for path in paths:
        log.info("wrote %s (%d records)", path, path.stat().st_size // RECORD_BYTES)
    return 0


if __name__ == "__main__":
    sys.exit(main())
