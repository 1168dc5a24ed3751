"""The CUDA device of a thread that saves: the process's, never GPU 0 by default.

CUDA's current device is per thread, and a new thread starts on device 0 whatever the thread
that started it set (torch's notes/cuda.rst: ``torch.cuda.set_device`` sets it "for the current
thread"). A save's thread on local rank 1 that makes a stream, an event or a pinned copy
without setting it first makes them on GPU 0: a CUDA context there, and a copy on a stream of
the wrong device. So every thread that may touch CUDA sets the device first: the one its
starter was on (``carried``), or the process's (``use_device``). Nothing happens off CUDA.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def use_device(device: Any) -> None:
    """Make ``device`` (a ``torch.device``, an index, or None: the CPU) this thread's CUDA
    device; call it first in a thread that touches CUDA."""
    import torch

    if device is None or not torch.cuda.is_available():
        return
    if isinstance(device, torch.device) and device.type != "cuda":
        return
    torch.cuda.set_device(device)


def current_device() -> int | None:
    """The calling thread's CUDA device; None when this process uses no GPU (yet)."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch.cuda.current_device()


def carried(work: Callable[[], T]) -> Callable[[], T]:
    """``work`` to run on another thread, on the CUDA device of the thread calling this."""
    device = current_device()

    def on_device() -> T:
        use_device(device)
        return work()

    return on_device
