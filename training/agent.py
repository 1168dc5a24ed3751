"""The worker container's entry point: check the rendezvous, then run ``torchrun``'s agent.

An unreachable etcd, or an endpoint that is not etcd's v3 API, would show as a client error at
the end of a long traceback. This check names the address, where it came from and the fix, and
waits a little first: worker pods may start before the etcd StatefulSet is ready. Then the
agent runs in this same process, so it is what receives the eviction's SIGTERM: by default
torch's elastic agent with warm workers (``training/launcher.py``), or, with
``TRAIN_LAUNCHER=torchrun``, torchrun itself exec'd with this rendezvous registered
(``training/plain_torchrun.py``).
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import signal
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from training.elastic.exit_codes import (
    BAD_INPUT,
    DEVICE_FAULT,
    OK,
    PERMANENT,
    RETRY_ME,
    after_spent_restarts,
    signal_exit,
)
from training.elastic.launch import (
    DATA_DIR_ENV,
    DATA_URI_ENV,
    ETCD_BACKENDS,
    LAUNCHER_ENV,
    LAUNCHERS,
)

if TYPE_CHECKING:  # imports torch: the checks before the launch run without it
    from training.elastic.rendezvous import SpotRendezvousHandler

logger = logging.getLogger("training.agent")


NOT_ETCD_V3 = "does not serve etcd's v3 API"
"""In a problem that no wait fixes: the endpoint answers, but not as etcd's v3 gateway."""


def etcd_v3_problem(endpoint: str, timeout_s: float = 2.0) -> str | None:
    """Why ``endpoint`` (host:port) cannot serve the rendezvous on etcd's v3 API, or None.

    One range read through the JSON gateway (``POST /v3/kv/range``, etcd's gRPC gateway),
    which every etcd from 3.4 on serves with no flag; its answer carries a ``header``.
    """
    url = f"http://{endpoint}/v3/kv/range"
    request = urllib.request.Request(url, data=b'{"key": "Lw=="}', method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            if "header" in json.loads(response.read()):
                return None
            return f"{endpoint} {NOT_ETCD_V3}: POST {url} answered JSON without a header"
    except urllib.error.HTTPError as exc:
        if exc.code == 400 and b"HTTPS server" in exc.read():
            return _tls(endpoint, "HTTP 400, 'an HTTP request to an HTTPS server'")
        return (
            f"{endpoint} {NOT_ETCD_V3} (POST {url}: HTTP {exc.code}): not etcd, or an etcd "
            "older than 3.4; run etcd 3.5 or 3.6"
        )
    except ValueError:  # an answer that is not JSON: some other HTTP server
        return f"{endpoint} {NOT_ETCD_V3}: POST {url} did not answer JSON"
    except (http.client.HTTPException, ConnectionResetError) as exc:
        # Plain HTTP to a TLS port: the server hangs up, or answers bytes that are no HTTP.
        return _tls(endpoint, type(exc).__name__)
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, ConnectionResetError):  # accepted, then hung up on the request
            return _tls(endpoint, "the connection was reset")
        return f"cannot reach etcd at {endpoint} ({reason})"


def _tls(endpoint: str, answer: str) -> str:
    # A TLS etcd (Go's net/http) answers plain HTTP with a 400 that says so; others hang up.
    return (
        f"{endpoint} {NOT_ETCD_V3} over plain HTTP ({answer}): it wants TLS, and the "
        "rendezvous speaks http:// to the cluster's etcd (workloads/manifests/etcd.py)"
    )


def check_rendezvous(
    env: Mapping[str, str],
    wait_s: float,
    probe: Callable[[str], str | None] = etcd_v3_problem,
    sleep: Callable[[float], None] = time.sleep,
) -> str | None:
    """None when the rendezvous in the PET_* env is usable (or not etcd); else the error."""
    if env.get("PET_RDZV_BACKEND", "") not in ETCD_BACKENDS:
        return None
    endpoint = env.get("PET_RDZV_ENDPOINT", "")
    if not endpoint:
        return "PET_RDZV_ENDPOINT is empty: the elasticPolicy needs rdzvHost and rdzvPort"
    deadline = time.monotonic() + wait_s
    while True:
        problem = probe(endpoint)
        # An endpoint that is not etcd's v3 API will not fix itself; a starting etcd may.
        if problem is None or NOT_ETCD_V3 in problem or time.monotonic() >= deadline:
            break
        sleep(1.0)
    if problem is None:
        return None
    return (
        f"rendezvous check failed: {problem}. The endpoint is PET_RDZV_ENDPOINT, which the "
        "PyTorchJob's elasticPolicy.rdzvHost/rdzvPort (or the lab's embedded etcd) sets; "
        "check that etcd is running and reachable from this pod."
    )


def main(
    argv: Sequence[str] | None = None,
    env: Mapping[str, str] | None = None,
    execv: Callable[[str, list[str]], None] = os.execv,
) -> int:
    """Check, then run torchrun ARGV: warm in this process, or exec'd (``TRAIN_LAUNCHER``)."""
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(message)s")
    env = os.environ if env is None else env
    args = list(sys.argv[1:] if argv is None else argv)
    launcher = env.get(LAUNCHER_ENV) or LAUNCHERS[0]
    if launcher not in LAUNCHERS:
        logger.error("%s must be one of %s, got %r", LAUNCHER_ENV, ", ".join(LAUNCHERS), launcher)
        return BAD_INPUT
    problem = check_rendezvous(env, wait_s=float(env.get("TRAIN_RDZV_WAIT_S", "120")))
    if problem is not None:
        # An endpoint that is not etcd's v3 API fails every pod alike: the job fails. An etcd
        # still unreachable after the wait may be back for a new pod (the operator retries).
        code = BAD_INPUT if NOT_ETCD_V3 in problem else RETRY_ME
        logger.error("%s; exiting %d", problem, code)
        return code
    code = fetch_data(env)
    if code is not None:
        return code
    if launcher == "warm":
        return _run_warm_to_a_code(args)
    execv(sys.executable, [sys.executable, "-m", "training.plain_torchrun", *args])
    return 0  # only reached when execv is a test double


def fetch_data(env: Mapping[str, str]) -> int | None:
    """Copy the dataset to node-local disk when ``TRAIN_DATA_URI`` asks; an exit code if not."""
    from training.data.fetch_data import fetch_dataset

    uri = env.get(DATA_URI_ENV, "")
    if not uri:
        return None
    dest = env.get(DATA_DIR_ENV, "")
    if not dest:
        logger.error(
            "%s is set but %s is empty: where should the data go?", DATA_URI_ENV, DATA_DIR_ENV
        )
        return BAD_INPUT
    try:
        fetch_dataset(uri, dest)
    except ValueError as exc:  # no data, a refused identity, a bad URI
        logger.error("%s", exc)
        return BAD_INPUT
    except OSError as exc:  # the store is unreachable from this node: a new pod may do better
        logger.error("cannot copy the dataset from %s (%s): exiting %d", uri, exc, RETRY_ME)
        return RETRY_ME
    return None


def _run_warm_to_a_code(args: list[str]) -> int:
    """``run_warm``; whatever else leaves it is a code the operator retries, never 1.

    A signal's exception (one that landed before the agent held its stop) is 128 + the
    signal; any other exception is the agent's own failure, not the job's, and a new pod may
    not meet it: 138. Exit 1 is left to the endings ``_ending`` names.
    """
    from torch.distributed.elastic.multiprocessing import SignalException

    from training.launcher import STOP

    handlers: list[SpotRendezvousHandler] = []  # the one launch makes, once it made it
    try:
        return run_warm(args, handlers)
    except SignalException as exc:
        STOP.hold()
        code = signal_exit(exc.sigval)
        logger.error("stopped by signal %s: exiting %d (the operator retries it)", exc.sigval, code)
    except Exception:
        STOP.hold()
        code = RETRY_ME
        logger.exception("the agent failed: exiting %d for a new pod", code)
    _leave_rendezvous(handlers)
    return code


def _leave_rendezvous(handlers: list[SpotRendezvousHandler]) -> None:
    """Leave the rendezvous (best effort), so the peers do not wait out this node's heartbeat."""
    for handler in handlers:
        try:
            handler.leave()
        except Exception as exc:  # noqa: BLE001 - the node exits next, whatever happens here
            logger.warning("could not leave the rendezvous: %s", exc)


def run_warm(args: list[str], handlers: list[SpotRendezvousHandler]) -> int:
    """The warm launcher, its ways of ending mapped onto the codes the operator understands."""
    from training.launcher import STOP

    code, close = _launch_warm(args, handlers)
    STOP.hold()  # the agent's work is done: a SIGTERM from now on is recorded, not raised
    # torch's launcher would have closed the rendezvous id on every ending but a signal;
    # here it closes only when the run is over for good, and the node leaves the round
    # itself, so nobody waits out its heartbeat (training/elastic/rendezvous.py). The closing
    # says why, for a node that starts after the end (training/elastic/closing.py).
    from training.elastic.closing import why

    # The node goes (its SIGTERM came before or after its ending): its save must not go with
    # it. A finished run committed its final state already. Committed before the node leaves:
    # a round waits for the last one's members until they joined or left (rounds.py), so the
    # next one cannot restore an older state while this node's newer one is on its way
    # (chaos seed 23 lost 26 steps so). The peers wait for it at most the stop deadline.
    committed = _going(code)
    if committed:
        for handler in handlers:
            handler.withdraw()  # a member of no new round, which waits for it all the same
        _commit_node_save(args)
    for handler in handlers:
        handler.settle(close=close, why=why(code))
    if not committed and _going(code):  # the SIGTERM landed while the node left
        _commit_node_save(args)
    return code


def _going(code: int) -> bool:
    """Whether the node is going away: its SIGTERM came, and the run is not over."""
    from training.launcher import STOP

    return code != OK and (code == signal_exit(signal.SIGTERM) or STOP.at is not None)


def _commit_node_save(args: list[str]) -> None:
    """Before the node leaves the rendezvous: its newest save made durable, within the deadline
    from the SIGTERM (training/loop/saves/emergency.py, ``commit_node_save``)."""
    from training.launcher import STOP, torchrun_config
    from training.loop.config import ConfigError, parse_config
    from training.loop.saves.emergency import commit_node_save

    try:
        parsed, config = torchrun_config(args)
        cfg = parse_config(parsed.training_script_args)
    except (ValueError, ConfigError) as exc:  # it parsed before the agent ran: not expected
        logger.error("cannot commit the node's save: %s", exc)
        return
    commit_node_save(cfg, config.run_id, STOP.at)


def _launch_warm(
    args: list[str], handlers: list[SpotRendezvousHandler] | None = None
) -> tuple[int, bool]:
    """(exit code, whether the rendezvous should close)."""
    from training.launcher import STOP, launch

    try:
        launch(args, handlers)
    except BaseException as exc:  # noqa: BLE001 - each is an ending below, or raised again
        STOP.hold()  # first: a SIGTERM must not replace the ending it lands in
        return _ending(exc)
    STOP.hold()
    return OK, True


def _device_fault(why: str) -> tuple[int, bool]:
    # Every restart here would meet the same GPU: the node leaves the rendezvous at once (its
    # peers re-form without it) and a new pod, on a node with a sound GPU, joins the run.
    logger.error(
        "a fault of this node's GPU (%s): leaving the rendezvous, exiting %d for a new pod",
        why,
        RETRY_ME,
    )
    return RETRY_ME, False


def _ending(exc: BaseException) -> tuple[int, bool]:
    """The ending ``launch`` raised, as (exit code, whether the rendezvous should close);
    anything not named here is raised again (``_run_warm_to_a_code`` makes it 138)."""
    # Imports torch: after the cheap checks. Public names only (each module's __all__).
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import (
        RendezvousClosedError,
        RendezvousError,
        RendezvousGracefulExitError,
        RendezvousTimeoutError,
    )

    from training.elastic.closing import RunFailedError, RunFinishedError
    from training.elastic.rendezvous import BadInputAfterJoin, ReformTimeoutError
    from training.launcher import DeviceFault

    try:
        raise exc
    except DeviceFault as exc:
        return _device_fault(str(exc))
    except ValueError as exc:  # bad flags or data, or a launcher that cannot run, before joining
        logger.error("%s", exc)
        return BAD_INPUT, False
    except SignalException as exc:
        # torch's agent turns SIGTERM into this exception after stopping its workers (which
        # saved on the same signal). Uncaught it would exit 1, which the ExitCode policy
        # treats as permanent: the first eviction would fail the whole job.
        code = signal_exit(exc.sigval)
        logger.info("stopped by signal %s: exiting %d (the operator retries it)", exc.sigval, code)
        return code, False
    except BadInputAfterJoin as exc:
        logger.error("%s; stopping without another restart", exc)
        return BAD_INPUT, True
    except ChildFailedError as exc:
        codes = [failure.exitcode for failure in exc.failures.values()]
        if DEVICE_FAULT in codes:  # its last restart: the file was not read before the end
            return _device_fault(f"a worker exited {DEVICE_FAULT}")
        code = after_spent_restarts(codes)
        if code == RETRY_ME:
            logger.error(
                "the restart budget went on lost peers (workers exited %s): exiting %d, so a "
                "new pod with a fresh budget joins the same run",
                codes,
                code,
            )
        else:
            logger.error(
                "the workers failed (exit codes %s) and no restart fixed it: %s. Fix the "
                "cause and start a new run (runId).",
                codes,
                exc.get_first_failure()[1].message if exc.failures else exc,
            )
        return code, code != RETRY_ME
    except RunFinishedError:
        # A replacement pod scheduled as training ended, a slow cold start. Exit 1 here could
        # fail the finished job: training-operator v1.9.x sets Failed for a pod's exit 1 before
        # Succeeded for its peers' 0 in the same reconcile, and keeps Failed
        # (tests/training/test_late_join.py cites the lines).
        logger.info("the run finished before this node joined: nothing to do")
        return OK, False
    except RunFailedError:
        logger.error(
            "the rendezvous is closed for this id: the run failed for good before this node "
            "joined (the first nodes' logs say why); start a new run with a new runId"
        )
        return PERMANENT, False
    except RendezvousClosedError:  # closed by an agent that kept no reason
        logger.error(
            "the rendezvous is closed for this id (the run finished, or failed for good): "
            "start a new run with a new runId"
        )
        return PERMANENT, False
    except RendezvousTimeoutError as exc:  # the first round only (training/elastic/rounds.py)
        logger.error(
            "too few nodes joined in time (%s): the GPU pool could not grow (Spot capacity or "
            "quota?). Failing the job frees the nodes that did come.",
            exc,
        )
        return PERMANENT, True
    except ReformTimeoutError as exc:
        # A group trained already: a re-form that cannot complete (too few live nodes for
        # now) is no reason to end the run. A new pod joins the same, open rendezvous.
        logger.error("%s: exiting %d for a new pod", exc, RETRY_ME)
        return RETRY_ME, False
    except RendezvousGracefulExitError as exc:
        # To its peers this node is gone (its probe refuses): it cannot train with them again.
        logger.error("this node left the rendezvous (%s): exiting %d for a new pod", exc, RETRY_ME)
        return RETRY_ME, False
    except RendezvousError as exc:
        # An etcd outage: torch's agent raises out of its monitoring loop. Exiting 1 would
        # fail the job for good under ExitCode; 138 asks the operator for a new pod.
        logger.error("rendezvous failed (%s): exiting %d for a new pod", exc, RETRY_ME)
        return RETRY_ME, False


if __name__ == "__main__":
    sys.exit(main())
