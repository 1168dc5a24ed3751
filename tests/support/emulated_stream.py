"""NCCL's ordering on gloo, for tests: the gradient stream they supply to the step guard
(``TRAIN_GRADIENT_STREAM``, training/loop/step_guard.py) where no GPU is at hand.

``backward()`` returns once each bucket's all-reduce is *queued* on a stream (a thread that runs
them in order); the all-reduce writes into the gradients (DDP's ``gradient_as_bucket_view``)
when it runs, later; one that fails leaves the peer's share missing.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

REFERENCE = "tests.support.emulated_stream:EmulatedStream"
"""What a test sets ``TRAIN_GRADIENT_STREAM`` to."""


class EmulatedStream:
    """A CPU stand-in for a CUDA stream: work queued here runs later, in order, on a thread."""

    def __init__(self) -> None:
        self._work: queue.Queue[Callable[[], None]] = queue.Queue()
        self._failed = False
        threading.Thread(target=self._run, name="emulated-stream", daemon=True).start()

    def enqueue(self, work: Callable[[], None]) -> None:
        self._work.put(work)

    def _run(self) -> None:
        while True:
            work = self._work.get()
            try:
                work()
            except Exception as exc:  # the peer is gone: its share never arrives, as on a GPU
                logger.debug("emulated stream-ordered work failed silently: %s", exc)
                self._failed = True
            finally:
                self._work.task_done()

    def synchronize(self, timeout_s: float) -> bool:
        drained = threading.Event()
        self.enqueue(drained.set)
        if not drained.wait(timeout_s):
            return False
        failed, self._failed = self._failed, False
        return not failed

    @staticmethod
    def comm_hook(
        state: EmulatedStream, bucket: dist.GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        """DDP's averaging all-reduce with NCCL's ordering: its future completes once the
        all-reduce is queued; the all-reduce writes the bucket (the gradients' views) later."""
        group = dist.group.WORLD
        buffer = bucket.buffer()
        buffer.div_(group.size())
        state.enqueue(lambda: dist.all_reduce(buffer, group=group))
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(buffer)
        return done


# DDP checks a hook's annotations as objects (``_check_comm_hook``); this module's are strings.
EmulatedStream.comm_hook.__annotations__ = {
    "state": Any,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}
