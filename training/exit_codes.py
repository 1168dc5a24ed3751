"""How a training node (the ``pytorch`` container: ``python -m training.agent``) ends, as a code.

The PyTorchJob runs under the operator's ``ExitCode`` restart policy. training-operator v1
(``pkg/util/train/train_util.go``, ``IsRetryableExitCode``) recreates the pod only for 130, 137,
143 and 138, and fails the whole job on any other code, which frees its GPU nodes. So an
eviction must end as a signal code, and what no retry can fix must not.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

OK = 0
PERMANENT = 1
"""Restarts spent (the rendezvous is then closed for good: start again with a new runId), or
the workers failed in a way no restart fixed."""
BAD_INPUT = 2
RETRY_ME = 138
"""SIGUSR1's code, which the operator retries by convention ("retry me"): etcd unreachable or
in a bad state, a cause outside this node that a new pod may not meet."""
"""A bad flag or config, a missing or unreadable dataset, an etcd without the v2 API."""
# Signals the operator retries, as the shell reports a process they ended: 128 + signal.
RETRYABLE = frozenset({130, 137, 138, 143})


def signal_exit(signum: int) -> int:
    """The code of a process ended by ``signum``: 143 for SIGTERM, 130 for SIGINT."""
    return 128 + int(signum)


@dataclass(frozen=True)
class Ending:
    """One way a node ends, its code, and what the operator does with it."""

    how: str
    code: int

    @property
    def retried(self) -> bool:
        """Whether the operator recreates the pod (else the job fails)."""
        return self.code in RETRYABLE


ENDINGS: tuple[Ending, ...] = (
    Ending("training finished", OK),
    Ending("eviction or pod deletion (SIGTERM), after the emergency save", signal_exit(15)),
    Ending("interrupted (SIGINT)", signal_exit(signal.SIGINT)),
    Ending("killed (SIGKILL, out of memory): the kernel's code", signal_exit(signal.SIGKILL)),
    Ending("bad flag, bad config or etcd without the v2 API, before joining", BAD_INPUT),
    Ending("dataset missing or unreadable, before joining", BAD_INPUT),
    Ending(
        "etcd unreachable, or the rendezvous state broken (RendezvousConnectionError)", RETRY_ME
    ),
    Ending("too few nodes joined within rdzvJoinTimeout (capacity or quota)", PERMANENT),
    Ending("rendezvous closed for this id (a finished run, or spent restarts)", PERMANENT),
    Ending("restart budget spent, or workers failed on every restart", PERMANENT),
)
