"""How a training node (the ``pytorch`` container: ``python -m training.agent``) ends, as a code.

The PyTorchJob runs under the operator's ``ExitCode`` restart policy. training-operator v1.9.4
(kubeflow/trainer at tag v1.9.4, ``pkg/util/train/train_util.go``: ``IsRetryableExitCode``
returns ``exitCode >= 128``; applied in ``pkg/controller.v1/common/pod.go``) deletes a failed
pod and makes a new one for every code from 128 up (130, 137, 138, 143, and also 134 SIGABRT
and 139 SIGSEGV), and fails the whole job on 1 to 127, which frees its GPU nodes. A pod whose
container status it cannot read counts as 0xbeef, retried too. ``backoffLimit`` does not bound
those retries: it sums in-place container restarts (``pkg/core/job.go``, ``PastBackoffLimit``),
and under ``ExitCode`` the pods run with ``restartPolicy: Never`` (``pkg/core/pod.go``).

So an eviction, and anything else a new pod may not meet, ends as 128 or more; what no retry
can fix ends as 1 or 2 and must not look like a signal.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

OK = 0
PERMANENT = 1
"""A real bug (a worker's uncaught exception), or a rendezvous closed as failed for good."""
BAD_INPUT = 2
"""A bad flag or config, a dataset missing or unreadable, an endpoint that is not etcd's v3 API."""
RETRY_ME = 138
"""SIGUSR1's code, which the operator retries by convention ("retry me"): a cause outside this
node that a new pod, with a fresh restart budget, may not meet."""
WORKER_RESTART = 75
"""A worker's own code (EX_TEMPFAIL) after a stop, a lost peer or a storage failure, its state
saved: what every survivor of an eviction exits with."""
LOCAL_ERROR = 70
"""A worker's own code (EX_SOFTWARE) for an exception its peers did not raise with it
(training/elastic/faults.py, ``every_rank_raised``): this rank's, not the job's; a restart, or
a new pod once the restarts are spent, may not meet it. Only an exception every rank raised
exits 1."""
DEVICE_FAULT = 74
"""A worker's own code (EX_IOERR) for a fault of this node's GPU (training/elastic/faults.py,
``is_device_fault``): its agent leaves the rendezvous at once, without a restart on the same
device, and the node ends 138 for a new pod."""
DEVICE_FAULT_ENV = "TRAIN_DEVICE_FAULT_FILE"
"""A file a worker writes when its device failed: the agent then leaves at once."""
VERDICT_ENV = "TRAIN_VERDICT_FILE"
"""A file a worker writes when it stopped on bad input: the agent then stops at once."""
OPERATOR_RETRIES_FROM = 128
"""The lowest code the operator retries (``IsRetryableExitCode``); every code below fails the
job."""


def retried(code: int) -> bool:
    """Whether training-operator v1.9.4 makes a new pod for a container that exited ``code``."""
    return code >= OPERATOR_RETRIES_FROM


def signal_exit(signum: int) -> int:
    """The code of a process ended by ``signum``: 143 for SIGTERM, 130 for SIGINT."""
    return 128 + int(signum)


def after_spent_restarts(worker_codes: list[int]) -> int:
    """The node's code once its agent gave up, from its workers' codes in the last round.

    Bad input stays bad input; a round every worker left because a peer vanished (or it was
    stopped: 75, or 138 when its durable commit gave up at the stop's deadline), on an error
    of its own that its peers did not share (70) or on a fault of its device (74) is a cause a
    new pod may not meet; anything
    else (an error every rank raised: 1) is a bug.
    """
    if BAD_INPUT in worker_codes:
        return BAD_INPUT
    retried_by_a_new_pod = (WORKER_RESTART, RETRY_ME, LOCAL_ERROR, DEVICE_FAULT)
    if worker_codes and all(code in retried_by_a_new_pod for code in worker_codes):
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
        return retried(self.code)


ENDINGS: tuple[Ending, ...] = (
    Ending("training finished", OK),
    Ending("eviction or pod deletion (SIGTERM), after the emergency save", signal_exit(15)),
    Ending("interrupted (SIGINT)", signal_exit(signal.SIGINT)),
    Ending("killed (SIGKILL, out of memory): the kernel's code", signal_exit(signal.SIGKILL)),
    Ending(
        "bad flag or config, or an endpoint not etcd's v3 API (or TLS), before joining", BAD_INPUT
    ),
    Ending("etcd still unreachable after the agent's wait, before joining", RETRY_ME),
    Ending("dataset missing or unreadable, or the identity refused it, before joining", BAD_INPUT),
    Ending("dataset's store unreachable from this node", RETRY_ME),
    Ending("bad input a worker found after joining (another run's checkpoint)", BAD_INPUT),
    Ending(
        "etcd unreachable, or the rendezvous state broken (RendezvousConnectionError)", RETRY_ME
    ),
    Ending("restart budget spent on lost peers (evictions); the rendezvous stays open", RETRY_ME),
    Ending("restart budget spent on a worker's crash (a bug); the rendezvous closes", PERMANENT),
    Ending("first round: too few nodes joined in rdzvJoinTimeout (capacity or quota)", PERMANENT),
    Ending(
        "a later round did not complete within rdzvJoinTimeout; the rendezvous stays open", RETRY_ME
    ),
    Ending("the warm launcher cannot run (a preload fails to import, torch changed)", BAD_INPUT),
    Ending("started after the run finished (its rendezvous closed as finished)", OK),
    Ending(
        "rendezvous closed for this id as failed for good (or by an agent that kept no reason)",
        PERMANENT,
    ),
    Ending("this node left the rendezvous, its peers re-formed without it", RETRY_ME),
    Ending("a fault of this node's GPU (CUDA or NCCL): the node leaves at once", RETRY_ME),
    Ending("the agent failed (an exception of its own, not the job's)", RETRY_ME),
    Ending("the agent crashed on a signal (SIGSEGV; SIGABRT is 134)", signal_exit(signal.SIGSEGV)),
)
