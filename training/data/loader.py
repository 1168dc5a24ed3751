"""This rank's items of each micro-batch, read ahead of the step by loader threads.

The order is the sampler's: the loader only reads ahead what the step will ask for, so a run
with loader threads trains on exactly the items, in the order, of one without, and a resume at
any world size continues where the global batch stream stopped (the step is the whole
position: training/data/sampler.py).

Threads, not worker processes (torch's DataLoader workers): a forked worker would inherit the
node-local prune's lock descriptors and the SIGTERM handler, and a spawned one would pickle the
dataset and pay its import per round. Reads that are slow are slow on I/O (a disk, Blob), which
releases the GIL, and so do torch's tensor ops; a task whose ``__getitem__`` is heavy pure Python
decoding would want processes. The worker starts no process, so nothing forks while a loader
thread holds a lock (lab/local/process_tree.py's rule against preexec_fn), and no child's
PR_SET_PDEATHSIG is tied to a loader thread (it fires when the creating thread exits).

A stream's position is not a loader's state, as torchdata's ``StatefulDataLoader`` keeps it
(items yielded, per rank and per worker): that state cannot be split again at another world
size. Here the global stream is cut by the step alone, which the checkpoint holds already.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import torch

from training.api import Samples, Stream, TaskContractError, is_stream
from training.data.sampler import ElasticSampler, StreamSampler, rank_share

_POLL_S = 0.1
"""How often a reader blocked on a full queue looks whether it was closed."""


class StreamEnded(TaskContractError):
    """The stream holds fewer items than the steps ask for: the same in every round, so the
    job ends with exit 2 rather than restart into it."""


class Loader(Protocol):
    def items(self, step: int, indices: torch.Tensor) -> list[Any]:
        """The items at ``indices`` (this rank's, in order) of optimiser step ``step``."""
        ...

    def close(self) -> None: ...


def sampler_for(train: Samples | Stream, global_batch: int, seed: int) -> Any:
    """The sampler of a training split: a seeded permutation per epoch, or a stream's order."""
    if is_stream(train):
        return StreamSampler(global_batch)
    return ElasticSampler(len(train), global_batch, seed)  # type: ignore[arg-type]


def open_loader(
    train: Samples | Stream, sampler: Any, world_size: int, rank: int, workers: int, ahead: int
) -> Loader:
    """A stream's reader thread; indexable samples read by ``workers`` threads ``ahead`` steps
    ahead, or in the training thread when ``workers`` is 0."""
    if is_stream(train):
        return StreamLoader(train, sampler.global_batch, world_size, rank, ahead)  # type: ignore[arg-type]
    if workers == 0:
        return InlineLoader(train)  # type: ignore[arg-type]
    return PrefetchLoader(train, sampler, world_size, rank, workers, ahead)  # type: ignore[arg-type]


class InlineLoader:
    """Each item read when the step asks for it, in the training thread."""

    def __init__(self, samples: Samples) -> None:
        self.samples = samples

    def items(self, step: int, indices: torch.Tensor) -> list[Any]:
        return [self.samples[i] for i in indices.tolist()]

    def close(self) -> None:
        pass


class PrefetchLoader:
    """Indexable samples read by a pool of threads: the items of this step and of the next
    ``ahead`` steps are requested when a step asks for its first micro-batch."""

    def __init__(
        self, samples: Samples, sampler: Any, world_size: int, rank: int, workers: int, ahead: int
    ) -> None:
        self.samples, self.sampler = samples, sampler
        self.world_size, self.rank, self.ahead = world_size, rank, ahead
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="loader")
        self.pending: dict[tuple[int, int], Future[Any]] = {}
        self.requested = -1
        """The last step whose items were requested."""

    def items(self, step: int, indices: torch.Tensor) -> list[Any]:
        for old in [key for key in self.pending if key[0] < step]:
            self.pending.pop(old).cancel()
        if self.requested < step:
            self.requested = step - 1
        while self.requested < step + self.ahead:
            self.requested += 1
            for i in self.sampler.rank_indices(self.requested, self.world_size, self.rank).tolist():
                self.pending[(self.requested, i)] = self.pool.submit(self.samples.__getitem__, i)
        # A micro-batch asked for twice (the resume rehearsal) is read again.
        return [
            (
                self.pending.pop((step, i), None) or self.pool.submit(self.samples.__getitem__, i)
            ).result()
            for i in indices.tolist()
        ]

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class _End:
    def __init__(self, position: int) -> None:
        self.position = position


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class StreamLoader:
    """A stream read in order by one thread, from the first position of the step asked for;
    it keeps this rank's share of each global batch, up to ``ahead`` steps ahead of the step.

    Every rank reads the whole stream and keeps its share: a resume at any world size then
    needs no more than the step. A stream whose ``read(start)`` seeks (a shard index) makes
    that cheap; the reading is off the training thread either way."""

    def __init__(
        self, stream: Stream, global_batch: int, world_size: int, rank: int, ahead: int
    ) -> None:
        self.stream, self.global_batch = stream, global_batch
        self.first, self.count = rank_share(global_batch, world_size, rank)
        self.ahead = ahead
        self.received: dict[int, Any] = {}
        self.reader: _Reader | None = None

    def items(self, step: int, indices: torch.Tensor) -> list[Any]:
        positions = indices.tolist()
        start = step * self.global_batch
        self.received = {p: v for p, v in self.received.items() if p >= start}
        missing = [p for p in positions if p not in self.received]
        if missing and (
            self.reader is None
            or missing[0] < self.reader.next_position  # passed: a step asked for again
            or missing[0] - self.reader.next_position > (self.ahead + 1) * self.global_batch
        ):
            self._restart(start)
        for position in missing:
            while position not in self.received:
                assert self.reader is not None
                got = self.reader.take()
                if isinstance(got, _Failed):
                    raise got.error
                if isinstance(got, _End):
                    raise StreamEnded(
                        f"the training stream {self.stream.identity} ended after {got.position} "
                        f"items; step {step + 1} needs item {position}: a longer stream, or a "
                        f"lower --max-steps"
                    )
                self.received[got[0]] = got[1]
        return [self.received[p] for p in positions]

    def _restart(self, start: int) -> None:
        self.close()
        self.received = {}
        self.reader = _Reader(self, start, max(self.ahead, 1) * self.count + 1)

    def mine(self, position: int) -> bool:
        return self.first <= position % self.global_batch < self.first + self.count

    def close(self) -> None:
        if self.reader is not None:
            self.reader.stop.set()
            self.reader = None


class _Reader:
    """One pass over the stream from ``start``, in a daemon thread, into a bounded queue."""

    def __init__(self, owner: StreamLoader, start: int, size: int) -> None:
        self.next_position = start
        """The first position not yet taken from the queue."""
        self.queue: queue.Queue[Any] = queue.Queue(maxsize=size)
        self.stop = threading.Event()
        thread = threading.Thread(
            target=self._run, args=(owner, start), name="stream-reader", daemon=True
        )
        thread.start()

    def take(self) -> Any:
        got = self.queue.get()
        if isinstance(got, tuple):
            self.next_position = got[0] + 1
        return got

    def _put(self, value: Any) -> bool:
        while not self.stop.is_set():
            try:
                self.queue.put(value, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def _run(self, owner: StreamLoader, start: int) -> None:
        position = start
        try:
            for item in owner.stream.read(start):
                if owner.mine(position) and not self._put((position, item)):
                    return
                if self.stop.is_set():
                    return
                position += 1
            self._put(_End(position))
        except BaseException as exc:  # the training thread raises it when it gets there
            self._put(_Failed(exc))
