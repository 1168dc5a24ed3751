"""The loaders read exactly the items the sampler names, ahead of the step; a stream's position
is the step alone, so a resume at another world size continues where the global stream
stopped."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from training.api import is_stream
from training.data.loader import (
    InlineLoader,
    PrefetchLoader,
    StreamEnded,
    StreamLoader,
    open_loader,
    sampler_for,
)
from training.data.sampler import ElasticSampler, StreamSampler
from training.data.streams import open_stream, write_stream

GLOBAL = 6


class Numbers:
    """Indexable samples that note the thread each item was read in."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.threads: set[str] = set()
        self.digest = "numbers"

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> int:
        self.threads.add(threading.current_thread().name)
        return index * 10


class Counting:
    """A stream of 0, 1, 2, ... (``length`` items) that notes each ``read`` start."""

    identity = "counting@1"

    def __init__(self, length: int) -> None:
        self.length, self.starts = length, []  # type: ignore[var-annotated]

    def read(self, start: int) -> Iterator[Any]:
        self.starts.append(start)
        yield from range(start, self.length)


def _steps(loader: Any, sampler: Any, world: int, rank: int, steps: range) -> list[Any]:
    out: list[Any] = []
    for step in steps:
        indices = sampler.rank_indices(step, world, rank)
        for offset in range(0, len(indices), 2):  # micro-batches of 2
            out += loader.items(step, indices[offset : offset + 2])
    return out


def test_prefetching_threads_read_the_items_inline_reading_would() -> None:
    samples = Numbers(30)
    sampler = ElasticSampler(30, GLOBAL, seed=4)
    inline = _steps(InlineLoader(samples), sampler, 2, 1, range(9))
    loader = PrefetchLoader(samples, sampler, 2, 1, workers=3, ahead=2)
    samples.threads.clear()
    try:
        assert _steps(loader, sampler, 2, 1, range(9)) == inline
        first = sampler.rank_indices(0, 2, 1)[:2]
        # The resume rehearsal asks for a micro-batch a second time.
        assert loader.items(0, first) == loader.items(0, first) == [i * 10 for i in first.tolist()]
    finally:
        loader.close()
    assert samples.threads and all(name.startswith("loader") for name in samples.threads)


def test_a_stream_resumed_at_another_world_size_continues_where_the_global_stream_stopped() -> None:
    sampler = StreamSampler(GLOBAL)
    stream = Counting(200)
    seen: dict[int, list[int]] = {}
    # Steps 0-2 at world size 2, then a "checkpoint" holding only the step (3), resumed at
    # world size 3 by new loaders, as a new round's processes would.
    for world, steps in ((2, range(0, 3)), (3, range(3, 7))):
        for rank in range(world):
            loader = StreamLoader(stream, GLOBAL, world, rank, ahead=2)
            try:
                for step in steps:
                    seen.setdefault(step, [])
                    seen[step] += _steps(loader, sampler, world, rank, range(step, step + 1))
            finally:
                loader.close()
    assert [item for step in sorted(seen) for item in seen[step]] == list(range(7 * GLOBAL))
    assert set(stream.starts) == {0, 3 * GLOBAL}  # each resumed rank started at the position


def test_the_stream_position_is_the_step_at_any_world_size() -> None:
    sampler = StreamSampler(GLOBAL)
    for world in (1, 2, 4, 6):
        shares = [sampler.rank_indices(5, world, rank) for rank in range(world)]
        assert torch.cat(shares).tolist() == list(range(5 * GLOBAL, 6 * GLOBAL))
    assert sampler.epoch_of(1000) == 0 and sampler.consumed_samples(5) == 5 * GLOBAL


def test_a_stream_step_asked_for_again_is_read_again_from_its_position() -> None:
    stream = Counting(100)
    loader = StreamLoader(stream, GLOBAL, 1, 0, ahead=1)
    try:
        indices = StreamSampler(GLOBAL).rank_indices(2, 1, 0)
        assert loader.items(2, indices[:3]) == [12, 13, 14]
        assert loader.items(2, indices[:3]) == [12, 13, 14]  # kept: the same step
        assert loader.items(3, indices[:3] + GLOBAL) == [18, 19, 20]
        assert loader.items(1, indices[:3] - GLOBAL) == [6, 7, 8]  # passed: read again
    finally:
        loader.close()
    assert stream.starts == [12, 6]


def test_a_stream_shorter_than_the_steps_is_one_line_naming_the_position() -> None:
    loader = StreamLoader(Counting(10), GLOBAL, 1, 0, ahead=2)
    try:
        loader.items(0, torch.arange(6))
        with pytest.raises(
            StreamEnded, match=r"counting@1 ended after 10 items; step 2 needs item 10"
        ):
            loader.items(1, torch.arange(6, 12))
    finally:
        loader.close()


def test_an_error_of_the_streams_reader_is_raised_in_the_training_thread() -> None:
    class Broken(Counting):
        def read(self, start: int) -> Iterator[Any]:
            yield from range(start, start + 2)
            raise OSError("the Blob read timed out")

    loader = StreamLoader(Broken(100), GLOBAL, 1, 0, ahead=2)
    try:
        with pytest.raises(OSError, match="timed out"):
            loader.items(0, torch.arange(6))
    finally:
        loader.close()


def test_a_manifest_stream_skips_whole_shards_and_names_itself(tmp_path: Path) -> None:
    written = write_stream(tmp_path, "points", "7", [[[i]] for i in range(0, 3)] + [[[3], [4]]])
    stream = open_stream(tmp_path)
    assert stream == written and stream.identity == "points@7" and is_stream(stream)
    assert list(stream.read(2)) == [[2], [3], [4]]
    assert list(stream.read(4)) == [[4]]
    assert isinstance(sampler_for(stream, GLOBAL, 0), StreamSampler)
    loader = open_loader(stream, StreamSampler(GLOBAL), 1, 0, workers=0, ahead=1)
    assert isinstance(loader, StreamLoader)  # a stream always has its reader thread
    loader.close()


@pytest.mark.parametrize(
    ("remove", "message"),
    [
        ("manifest.json", "manifest.json does not exist: a stream needs its manifest"),
        ("part-001.jsonl", "part-001.jsonl: a shard manifest.json lists does not exist"),
    ],
)
def test_a_missing_manifest_or_shard_is_named(tmp_path: Path, remove: str, message: str) -> None:
    write_stream(tmp_path, "points", "1", [[1], [2]])
    (tmp_path / remove).unlink()
    with pytest.raises(FileNotFoundError, match=message):
        open_stream(tmp_path)
