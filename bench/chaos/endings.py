"""How an agent ended, from what it logged, as a row of ``training/exit_codes.py``'s ENDINGS.

The chaos checks compare every agent's exit code with the code the table gives for the ending
the agent reports. Each phrase below is what ``training/agent.py`` logs on that ending (a test
holds the two in step); the table, not this module, says which code goes with it.
"""

from __future__ import annotations

import re
import signal
import time

from training.elastic.exit_codes import ENDINGS, Ending

SIGTERM_ENDING = "eviction or pod deletion (SIGTERM), after the emergency save"
SIGKILL_ENDING = "killed (SIGKILL, out of memory): the kernel's code"
FINISHED_ENDING = "training finished"
CLOSED_ENDING = (
    "rendezvous closed for this id as failed for good (or by an agent that kept no reason)"
)

AGENT_SAYS: tuple[tuple[str, str], ...] = (
    ("stopped by signal 15:", SIGTERM_ENDING),
    ("stopped by signal 2:", "interrupted (SIGINT)"),
    (
        "a new pod with a fresh budget joins the same run",
        "restart budget spent on lost peers (evictions); the rendezvous stays open",
    ),
    (
        "no restart fixed it",
        "restart budget spent on a worker's crash (a bug); the rendezvous closes",
    ),
    (
        "too few nodes joined in time",
        "first round: too few nodes joined in rdzvJoinTimeout (capacity or quota)",
    ),
    (
        "did not complete within",
        "a later round did not complete within rdzvJoinTimeout; the rendezvous stays open",
    ),
    (
        "rendezvous failed (",
        "etcd unreachable, or the rendezvous state broken (RendezvousConnectionError)",
    ),
    (
        "the run finished before this node joined",
        "started after the run finished (its rendezvous closed as finished)",
    ),
    ("the rendezvous is closed for this id", CLOSED_ENDING),
    (
        "a fault of this node's GPU (",
        "a fault of this node's GPU (CUDA or NCCL): the node leaves at once",
    ),
    ("the agent failed: exiting", "the agent failed (an exception of its own, not the job's)"),
    (
        "this node left the rendezvous (",
        "this node left the rendezvous, its peers re-formed without it",
    ),
    (
        "stopping without another restart",
        "bad input a worker found after joining (another run's checkpoint)",
    ),
    ("cannot copy the dataset", "dataset's store unreachable from this node"),
    (
        "rendezvous check failed",
        "bad flag or config, or an endpoint not etcd's v3 API (or TLS), before joining",
    ),
)
"""(what the agent logs, the ENDINGS row it means)."""

_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ")


def ending(how: str) -> Ending:
    """The ENDINGS row named ``how``."""
    return next(e for e in ENDINGS if e.how == how)


def exit_code(returncode: int) -> int:
    """A process's code as the operator sees it: killed by signal N is 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def signal_name(code: int) -> str:
    try:
        return signal.Signals(code - 128).name
    except ValueError:
        return str(code)


def log_lines_between(text: str, start: float, end: float) -> list[str]:
    """The lines of an agent's log (``%(asctime)s`` first) stamped within [start, end]."""
    found = []
    for line in text.splitlines():
        match = _STAMP.match(line)
        if match is None:
            continue
        stamp = time.mktime(time.strptime(match[1], "%Y-%m-%d %H:%M:%S")) + int(match[2]) / 1000
        # The agent logs its ending just before it exits, and the lab sees the exit a poll
        # (0.2 s) later: the stamp falls inside the process's span or just before its end.
        if start <= stamp <= end + 0.5:
            found.append(line)
    return found


def reported(lines: list[str]) -> str | None:
    """The ending the agent reported in ``lines`` (the last one it logged), or None."""
    how = None
    for line in lines:
        for phrase, row in AGENT_SAYS:
            if phrase in line:
                how = row
    return how
