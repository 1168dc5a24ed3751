"""How a training node (the ``pytorch`` container: ``python -m training.agent``) ends, as a code.

The PyTorchJob runs under the operator's ``ExitCode`` restart policy. training-operator v1
(``pkg/util/train/train_util.go``, ``IsRetryableExitCode``) recreates the pod only for 130, 137,
143 and 138, and fails the whole job on any other code, which frees its GPU nodes. So an
eviction, and anything else a new pod may not meet, must end as one of those; what no retry can
fix must not.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

OK = 0
PERMANENT = 1
"""A real bug (a worker's uncaught exception), or a rendezvous closed for good."""
BAD_INPUT = 2
"""A bad flag or config, a dataset missing or unreadable, an etcd without the v2 API."""
RETRY_ME = 138
"""SIGUSR1's code, which the operator retries by convention ("retry me"): a cause outside this
node that a new pod, with a fresh restart budget, may not meet."""
WORKER_RESTART = 75
"""A worker's own code (EX_TEMPFAIL) after a stop, a lost peer or a storage failure, its state
saved: what every survivor of an eviction exits with."""
VERDICT_ENV = "TRAIN_VERDICT_FILE"
"""A file a worker writes when it stopped on bad input: the agent then stops at once."""
# Signals the operator retries, as the shell reports a process they ended: 128 + signal.
RETRYABLE = frozenset({130, 137, 138, 143})


def signal_exit(signum: int) -> int:
    """The code of a process ended by ``signum``: 143 for SIGTERM, 130 for SIGINT."""
    return 128 + int(signum)


def after_spent_restarts(worker_codes: list[int]) -> int:
    """The node's code once its agent gave up, from its workers' codes in the last round.

    Bad input stays bad input; a round every worker left because a peer vanished (or it was
    stopped) is an eviction's doing, which a new pod may not meet; anything else is a bug.
    """
    if BAD_INPUT in worker_codes:
        return BAD_INPUT
    if worker_codes and all(code == WORKER_RESTART for code in worker_codes):
        return RETRY_ME
    return PERMANENT


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
    Ending("dataset missing or unreadable, or the identity refused it, before joining", BAD_INPUT),
    Ending("dataset's store unreachable from this node", RETRY_ME),
    Ending("bad input a worker found after joining (another run's checkpoint)", BAD_INPUT),
    Ending(
        "etcd unreachable, or the rendezvous state broken (RendezvousConnectionError)", RETRY_ME
    ),
    Ending("restart budget spent on lost peers (evictions); the rendezvous stays open", RETRY_ME),
    Ending("restart budget spent on a worker's crash (a bug); the rendezvous closes", PERMANENT),
    Ending("too few nodes joined within rdzvJoinTimeout (capacity or quota)", PERMANENT),
    Ending("rendezvous closed for this id (the run finished, or failed for good)", PERMANENT),
)
