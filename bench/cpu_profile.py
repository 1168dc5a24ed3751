"""CPU time by role (workers, agents, etcd, the lab itself) while a run goes on.

On a two-core machine every CPU second an agent or etcd spends is taken from the workers,
so this is the profile that explains a steady-state step time ratio. A thread samples the
benchmark's descendants in /proc every ``interval_s`` and keeps each process's latest
user+system time; a process's last fraction of an interval before it exits is not seen.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from types import TracebackType

from lab.local import process_tree

PROC = Path("/proc")
ROLES = ("worker", "agent", "etcd", "lab", "other")


def role_of(cmdline: list[str]) -> str:
    """``agent`` (torchrun), ``worker`` (the training program), ``etcd`` or ``other``."""
    text = " ".join(cmdline)
    if "torch.distributed.run" in text or "training.agent" in text or "torchrun" in text:
        return "agent"
    if "training.train" in text:
        return "worker"
    if cmdline and Path(cmdline[0]).name == "etcd":
        return "etcd"
    return "other"


def _cpu_seconds(pid: int) -> float | None:
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _cmdline(pid: int) -> list[str]:
    try:
        raw = (PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


class CpuProfile:
    """``with CpuProfile() as cpu: ...``; then ``cpu.by_role()`` in CPU seconds."""

    def __init__(self, interval_s: float = 0.5) -> None:
        self.interval_s = interval_s
        self._latest: dict[int, tuple[str, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample_until_stopped, daemon=True)
        self._own_start = 0.0
        self._own_s = 0.0

    def sample(self) -> None:
        """Record the CPU time of every descendant of this process now."""
        for pid in process_tree.descendants(os.getpid()):
            seconds = _cpu_seconds(pid)
            if seconds is None:
                continue
            # Read every time: a child is its parent's copy until it execs. A zombie's
            # cmdline is empty: it keeps the role it had.
            cmdline = _cmdline(pid)
            known = self._latest.get(pid)
            role = role_of(cmdline) if cmdline or known is None else known[0]
            self._latest[pid] = (role, seconds)

    def _sample_until_stopped(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def __enter__(self) -> CpuProfile:
        self._own_start = time.process_time()
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join()
        # This process: the lab's runner (log tailing, status) and the sampler itself.
        self._own_s = time.process_time() - self._own_start

    def by_role(self) -> dict[str, float]:
        """CPU seconds per role; ``lab`` is this process (the lab's runner and the sampler)."""
        totals = dict.fromkeys(ROLES, 0.0)
        for role, seconds in self._latest.values():
            totals[role] += seconds
        totals["lab"] = self._own_s
        return {role: round(seconds, 2) for role, seconds in totals.items()}
