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
- ``StepGuard.check`` runs a one-element all-reduce on a gloo group of its own, after
  ``backward()`` and before ``optimizer.step()``. It blocks on the CPU and raises within the
  collective timeout when a peer is gone or frozen. It costs one small gloo round trip per step.
- ``abort_collectives`` then aborts the NCCL communicators, so the stuck kernels return.
- ``cpu_state`` copies the state on a CUDA stream of its own. The step that failed changed
  only gradients, never parameters or optimizer state, so those can be read without waiting
  for the stream that is stuck.

There is no GPU here. ``stream_ordered_allreduce_hook`` gives gloo NCCL's semantics as the CPU
sees them: its future completes even when the all-reduce failed, with the peer's share
missing. Tests turn it on with ``EMULATE_ENV``, which also turns the guard on.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from training.faults import PeerLostError

logger = logging.getLogger(__name__)

EMULATE_ENV = "TRAIN_EMULATE_STREAM_ORDERED_ALLREDUCE"
"""1: register ``stream_ordered_allreduce_hook`` on gloo and guard every step (tests, the lab)."""


def emulating() -> bool:
    return os.environ.get(EMULATE_ENV, "") == "1"


def needs_guard(backend: str) -> bool:
    """Whether the gradient all-reduce can complete without every peer's share."""
    return backend == "nccl" or emulating()


class StepGuard:
    """A synchronous "this step's all-reduce completed everywhere" check, on gloo."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group

    @classmethod
    def create(cls, backend: str, timeout_s: int) -> StepGuard:
        """Every rank calls this, in the same order as its other group creations."""
        if not needs_guard(backend):
            return cls(None)
        return cls(dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)))

    @property
    def active(self) -> bool:
        return self.group is not None

    def check(self) -> None:
        """Raise (a PeerLostError) when a peer did not finish this step; else return."""
        if self.group is None:
            return
        done = torch.ones(1)
        dist.all_reduce(done, group=self.group)
        if int(done.item()) != dist.get_world_size(self.group):
            raise PeerLostError(f"step guard: {int(done.item())} ranks finished the step")


def stream_ordered_allreduce_hook(
    state: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP's default averaging all-reduce, whose future completes even when it failed."""
    group = state if state is not None else dist.group.WORLD
    buffer = bucket.buffer()
    buffer.div_(group.size())
    work = dist.all_reduce(buffer, group=group, async_op=True).get_future()
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()

    def settle(future: torch.futures.Future[Any]) -> None:
        try:
            future.value()
        except Exception as exc:  # the peer is gone: its share never arrives, as on a GPU
            logger.debug("emulated stream-ordered all-reduce failed silently: %s", exc)
        done.set_result(buffer)

    work.add_done_callback(settle)
    return done


# DDP checks a hook's annotations as objects (``_check_comm_hook``); this module's are strings.
stream_ordered_allreduce_hook.__annotations__ = {
    "state": dist.ProcessGroup | None,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


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


def cpu_state(obj: Any) -> Any:
    """A CPU copy of a state tree, read on a CUDA stream of its own (none stuck behind NCCL)."""
    if not torch.cuda.is_available():
        return obj
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        copied = _to_cpu(obj)
    stream.synchronize()
    return copied


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True) if obj.is_cuda else obj
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj
