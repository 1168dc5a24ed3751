"""A lost peer raises before ``optimizer.step()`` on NCCL too, and the emergency save needs no
GPU stream.

On gloo, DDP's gradient all-reduce fails inside ``backward()`` when a peer is gone, so a
survivor never applies a half-reduced gradient. On NCCL it does not. DDP's reducer waits on the
all-reduce's future, and NCCL completes that future when the kernel is *enqueued*: the wait
only orders CUDA streams. A peer that dies mid all-reduce leaves ``backward()`` returning
normally. ``optimizer.step()`` then queues behind a kernel that never finishes, and so does
every later copy to the CPU, the emergency save's included, until the watchdog ends the process
with nothing saved.

So, where the default group's collectives complete like that:
- ``StepGuard.vote`` runs after ``backward()`` and before ``optimizer.step()``. First it waits,
  within the collective timeout, until this rank's gradient all-reduce has really finished:
  on a GPU it polls an event recorded on the current stream (which DDP made wait for the NCCL
  stream), so a kernel stuck on a dead peer never blocks it, and checks the error NCCL
  recorded (an aborted communicator's kernels return unfinished). Nothing reads a device value
  to the host before that wait: the read would wait for the stuck kernel with no bound. Then it
  all-reduces one number on a gloo group of its own: 1 if this rank's all-reduce finished, else
  0. Only when every rank says 1 has every rank the fully reduced gradient, so a peer can no
  longer pass the guard with its ring kernel still running and die after; the guard raises
  otherwise, or when a peer is gone or frozen. It costs one small gloo round trip per step.
- ``abort_collectives`` then aborts the NCCL communicators, so the stuck kernels return.
- ``cpu_state`` copies the state on a CUDA stream of its own. The step that failed changed
  only gradients, never parameters or optimizer state, so those can be read without waiting
  for the stream that is stuck. The copy stream waits only for the event the last completed
  step recorded after its optimizer step (``mark_state_written``), so it never reads a state
  half-way between two steps.
- The loop's other collective, the window loss for the metrics line, runs on the guard's gloo
  group too (``StepGuard.all_reduce``): a peer lost there fails it like any other lost peer,
  rather than leaving a NCCL kernel behind.

On every backend the guard also carries the stop: ``StepGuard.vote`` runs after all of a
step's collectives (the gradients', the clip's norm, fp16's overflow check) and before any
rank changes the state, and every rank applies the step only when every rank votes yes. A rank
whose SIGTERM's save claimed the state first (``StepGate``) votes no, so no peer applies a step
that save does not hold; a rank that voted yes applies the step before its save reads the
state. Without it, FSDP2 without clipping loses steps on the CPU too: the evicted rank's
reduce-scatter in backward is the last collective its peers need, they apply the step, and
its part holds the one before, so no set of parts is whole.

There is no GPU here. A test supplies a stream with NCCL's ordering on gloo (``STREAM_ENV``,
tests/support/emulated_stream.py), which also turns the guard on; the product holds none.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from training.elastic.faults import PeerLostError

logger = logging.getLogger(__name__)

STREAM_ENV = "TRAIN_GRADIENT_STREAM"
"""``module:attribute`` of a ``Stream`` class the gradient all-reduce is queued on off CUDA, with
NCCL's ordering (tests supply one); set, it guards every step on gloo too. Unset: gloo, whose
all-reduce never completes without every share, needs no guard."""


def supplied_stream() -> Callable[[], Stream] | None:
    """The ``Stream`` class ``STREAM_ENV`` names, or None; ValueError naming it if it does not
    import."""
    reference = os.environ.get(STREAM_ENV, "")
    if not reference:
        return None
    module, _, name = reference.partition(":")
    try:
        return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(
            f"{STREAM_ENV}={reference!r} names no Stream class (module:attribute): {exc}"
        ) from None


def needs_guard(backend: str) -> bool:
    """Whether the gradient all-reduce can complete without every peer's share."""
    return backend == "nccl" or bool(os.environ.get(STREAM_ENV))


class Stream(Protocol):
    """Where this rank's gradient all-reduce runs after ``backward()`` returned. A stream may
    also carry ``comm_hook``, DDP's hook that queues the all-reduce on it
    (``parallel/wrap.py`` registers it)."""

    def synchronize(self, timeout_s: float) -> bool:
        """True when all that was queued so far has finished, and succeeded, within
        ``timeout_s``; False otherwise. Never blocks longer."""


class CudaStream:
    """The current CUDA stream, which DDP made wait for the NCCL all-reduce; ``error`` says
    what NCCL's watchdog recorded on the group (``communicator_error``)."""

    def __init__(self, error: Callable[[], str | None] = lambda: None) -> None:
        self.error = error

    def synchronize(self, timeout_s: float) -> bool:
        done = torch.cuda.Event()
        done.record()
        give_up = time.monotonic() + timeout_s
        while not done.query():  # polled: a kernel stuck on a dead peer never returns
            if time.monotonic() > give_up:
                return False
            time.sleep(0.0002)
        # An aborted communicator (the watchdog's, on a timeout or a peer's error) lets its
        # kernels return with the reduction unfinished: the event alone cannot tell.
        failed = self.error()
        if failed is not None:
            logger.warning("the gradient all-reduce returned, but NCCL reports %s", failed)
        return failed is None


def communicator_error(group: dist.ProcessGroup | None = None) -> str | None:
    """What NCCL's watchdog recorded on ``group``'s NCCL backend (``TIMEOUT``, ``COMM_ERROR``,
    ``REMOTE_ERROR``: torch's ``ErrorType``, from ``ProcessGroupNCCL::getError``), or None
    while it reports ``SUCCESS`` or the backend has no such record."""
    try:
        backend = (group or dist.group.WORLD)._get_backend(torch.device("cuda"))
        error = backend.get_error()
    except (AttributeError, RuntimeError):  # not NCCL, or no NCCL backend on this group
        return None
    name = getattr(error, "name", str(error))
    return None if name == "SUCCESS" else name


class StepGuard:
    """A synchronous "this step's all-reduce completed everywhere" check, on gloo."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        stream: Stream | None = None,
        timeout_s: float = 30.0,
    ) -> None:
        self.group = group
        self.stream = stream
        self.timeout_s = timeout_s

    @classmethod
    def create(cls, backend: str, timeout_s: int) -> StepGuard:
        """Every rank calls this, in the same order as its other group creations."""
        if not needs_guard(backend):
            return cls(None)
        supplied = supplied_stream()  # before the group: a bad reference fails every rank alike
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        stream: Stream = (
            CudaStream(communicator_error) if backend == "nccl" or supplied is None else supplied()
        )
        logger.info("step guard: each step waits for its gradients on %s", type(stream).__name__)
        return cls(group, stream, timeout_s)

    @property
    def active(self) -> bool:
        return self.group is not None

    def settle(self) -> bool:
        """After ``backward()``, before anything reads the gradients: whether this rank's
        gradient all-reduce finished within the collective timeout (True where it cannot
        complete without every share: gloo)."""
        return self.stream is None or self.stream.synchronize(self.timeout_s)

    def vote(self, applies: bool) -> None:
        """Every rank's word on the step, after all of its collectives (the gradients', the
        clip's norm, fp16's overflow check) and before any rank changes the state: raise (a
        PeerLostError) unless every rank says it applies the step, so all apply it or none.

        ``applies`` is False on a rank whose stop claimed the state (``StepGate``), or whose
        gradient all-reduce did not finish (``settle``); where a collective can complete
        without a peer's share (NCCL), a rank also says no unless the collectives queued since
        finished within the collective timeout. On every backend: the
        stop is part of the vote, so a rank stopping inside the step keeps its peers from
        applying a step its save would not hold (one all-reduce of one number per step)."""
        if not dist.is_initialized():
            return
        finished = applies and (self.stream is None or self.stream.synchronize(self.timeout_s))
        done = torch.tensor([1.0 if finished else 0.0])
        dist.all_reduce(done, group=self.group)
        ranks = dist.get_world_size(self.group)
        if int(done.item()) != ranks:
            raise PeerLostError(
                f"step guard: {int(done.item())} of {ranks} ranks apply the step (the others "
                f"stop, or their gradient all-reduce did not finish within {self.timeout_s:g} s)"
            )

    def all_reduce(self, values: torch.Tensor) -> torch.Tensor:
        """Sum a small CPU tensor over the ranks on a group whose failures raise (the guard's
        gloo group when active; else the default group, which is gloo then)."""
        dist.all_reduce(values, group=self.group)
        return values


class StepGate:
    """Which of a step's sides a SIGTERM's save is on: the main thread enters the gate before
    its vote and leaves it once the step is applied (or refused); a stop claims the state.

    A stop that claims it before the main thread entered makes that rank vote no (``enter``
    is False), so no rank applies the step and the save holds the last applied one. A stop
    that comes once the rank is applying waits for it to leave (within its deadline). A stop
    that comes during the vote (a peer frozen inside it holds the vote's collective until the
    collective timeout) depends on the state: replicated (DDP), it takes the state at once and
    the rank will not apply the step (``applying`` is False), since a resume takes the newest
    replica; sharded (FSDP2, ``wait_for_vote``), it waits, since the peers may apply the step
    and every shard must hold the same one.
    """

    def __init__(self, wait_for_vote: bool = True) -> None:
        self.wait_for_vote = wait_for_vote
        self._lock = threading.Lock()
        self._claimed = False
        self._voting = False
        self._outside = threading.Event()
        self._outside.set()

    def enter(self) -> bool:
        """The main thread, before the vote: False when a stop claimed the state."""
        with self._lock:
            if self._claimed:
                return False
            self._voting = True
            self._outside.clear()
            return True

    def applying(self) -> bool:
        """The main thread, after its vote and before it changes the state: False when a stop
        took the state during the vote (replicated state only): the step must not be applied."""
        with self._lock:
            if self._claimed and not self.wait_for_vote:
                return False
            self._voting = False
            return True

    def leave(self) -> None:
        """The main thread, once the step is applied, or will not be."""
        with self._lock:
            self._voting = False
        self._outside.set()

    def claim(self, timeout_s: float | None) -> bool:
        """The stop's thread: no step is applied from now on; wait up to ``timeout_s`` (None:
        for good) for the one in flight, unless the state is replicated and the rank has not
        begun to apply it. False when it was still in flight then."""
        with self._lock:
            self._claimed = True
            if self._voting and not self.wait_for_vote:
                return True
        return self._outside.wait(timeout_s)


def abort_collectives() -> None:
    """Abort the default group's NCCL communicators, so kernels stuck on a dead peer return.

    ``ProcessGroup.abort`` is public in torch 2.13; gloo has nothing stuck to abort.
    """
    if not dist.is_initialized() or dist.get_backend() != "nccl":
        return
    try:
        dist.group.WORLD.abort()
        logger.info("aborted the NCCL communicators before the emergency save")
    except Exception as exc:  # the save must go on; the watchdog is the backstop
        logger.warning("could not abort the NCCL communicators: %s", exc)


class _StateWrites:
    """Where on the GPU the training state was last written: a CUDA event, or None."""

    event: Any = None


_WRITES = _StateWrites()


def mark_state_written(device: torch.device) -> None:
    """Call inside the state lock, after the step's last write to the state (the optimizer,
    the scheduler): ``cpu_state`` copies only after the kernels queued so far. No-op off CUDA.

    ``optimizer.step()`` returns once its kernels are queued, not run; the lock covers only
    the queueing. One event per process: a worker drives one GPU.
    """
    if device.type != "cuda":
        return
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    _WRITES.event = event


def cpu_state(obj: Any) -> Any:
    """A CPU copy of a state tree, read on a CUDA stream of its own (none stuck behind NCCL),
    after the last write ``mark_state_written`` recorded."""
    with state_reads():
        return _to_cpu(obj)


@contextmanager
def state_reads() -> Iterator[None]:
    """Inside: this thread's CUDA work runs on a stream of its own that starts after the last
    write ``mark_state_written`` recorded, and is done when the block ends (a sharded part's
    tensor-by-tensor copy runs in it). Nothing off CUDA."""
    if not torch.cuda.is_available():
        yield
        return
    stream = torch.cuda.Stream()
    written = _WRITES.event
    if written is not None:
        # Streams run concurrently unless synchronized (torch's notes/cuda.rst, "CUDA
        # streams"): unordered, the copy could read parameters the last optimizer step is
        # still writing, steps N-1 and N mixed. ``wait_event`` orders only work queued after
        # it on this stream, without blocking the host (torch/cuda/streams.py, a wrapper of
        # cudaStreamWaitEvent), and any device's stream may wait on the event (its
        # ``Event`` docstring). The event precedes the next step's collectives, so a kernel
        # stuck on a dead peer never holds it up.
        stream.wait_event(written)
    with torch.cuda.stream(stream):
        yield
    stream.synchronize()


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True) if obj.is_cuda else obj
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj
