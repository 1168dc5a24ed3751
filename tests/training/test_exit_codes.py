"""How a node ends, as the code the training operator's ExitCode policy acts on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from lab.local.etcd_server import EmbeddedEtcd, find_etcd_binary
from tests.support.elastic_cluster import TINY, Cluster
from training.data.cifar10 import write_synthetic_cifar10
from training.elastic.closing import FAILED, FINISHED, RunFailedError, RunFinishedError, why
from training.elastic.exit_codes import (
    BAD_INPUT,
    DEVICE_FAULT,
    ENDINGS,
    LOCAL_ERROR,
    PERMANENT,
    RETRY_ME,
    WORKER_RESTART,
    after_spent_restarts,
    retried,
    signal_exit,
)
from training.elastic.rendezvous import BadInputAfterJoin
from training.records import EMERGENCY_SAVE, METRICS, RESUMED, STARTED, completed_step

REPO = Path(__file__).resolve().parents[2]


def operator_retries(code: int) -> bool:
    """training-operator v1.9.4 (kubeflow/trainer, tag v1.9.4), pkg/util/train/train_util.go:
    ``func IsRetryableExitCode(exitCode int32) bool { return exitCode >= 128 }``, which
    pkg/controller.v1/common/pod.go applies under ``restartPolicy: ExitCode``."""
    return code >= 128


def test_the_table_agrees_with_the_operator() -> None:
    assert all(retried(code) == operator_retries(code) for code in range(256))
    # Every signal's code is retried, a crash's too: SIGABRT and SIGSEGV are no exception.
    assert retried(signal_exit(signal.SIGABRT)) and retried(signal_exit(signal.SIGSEGV))
    by_how = {e.how.split(" (")[0].split(",")[0]: e for e in ENDINGS}
    assert by_how["eviction or pod deletion"].code == 143
    assert by_how["eviction or pod deletion"].retried
    assert not by_how["training finished"].retried
    for ending in ENDINGS:
        if ending.code in (BAD_INPUT, PERMANENT):
            assert not ending.retried, ending  # fails the job and frees its GPU nodes
    assert signal_exit(signal.SIGTERM) == 143 and signal_exit(signal.SIGINT) == 130
    assert retried(RETRY_ME) and retried(WORKER_RESTART + 128) and not retried(WORKER_RESTART)


@pytest.mark.parametrize(
    ("worker_codes", "node_code"),
    [
        ([WORKER_RESTART, WORKER_RESTART], RETRY_ME),  # every worker lost a peer: evictions
        # A stopped worker whose durable commit gave up at the deadline: still an eviction's.
        ([RETRY_ME], RETRY_ME),
        ([WORKER_RESTART, RETRY_ME], RETRY_ME),
        ([RETRY_ME, 1], PERMANENT),
        ([WORKER_RESTART, 1], PERMANENT),  # one crashed: a bug, whatever the others did
        ([1], PERMANENT),
        ([-9], PERMANENT),  # a worker killed outright (out of memory) again and again
        ([WORKER_RESTART, BAD_INPUT], BAD_INPUT),
        ([], PERMANENT),
        # An error only this rank raised (its peers were training on), or its GPU's fault.
        ([LOCAL_ERROR, WORKER_RESTART], RETRY_ME),
        ([DEVICE_FAULT], RETRY_ME),
        ([LOCAL_ERROR, 1], PERMANENT),
    ],
)
def test_spent_restarts_end_by_what_spent_them(worker_codes: list[int], node_code: int) -> None:
    assert after_spent_restarts(worker_codes) == node_code


def test_missing_data_stops_the_node_before_it_joins(
    etcd_server: EmbeddedEtcd, tmp_path: Path
) -> None:
    # Every worker would fail the same way on every restart, spending the whole budget on
    # billed GPU nodes; the agent checks the data first and exits 2, which fails the job.
    env = {
        "PATH": "/usr/bin:/bin",
        "TRAIN_RDZV_WAIT_S": "0",
        "TRAIN_LAUNCHER": "warm",
        "PET_RDZV_BACKEND": "etcd",
        "PET_RDZV_ENDPOINT": f"127.0.0.1:{etcd_server.client_port}",
    }
    args = ["--nnodes=1", "--rdzv-id=missing-data", "--module", "training.train"]
    args += ["--data-dir", str(tmp_path / "nothing"), "--checkpoint-uri", str(tmp_path / "c")]
    result = subprocess.run(
        [sys.executable, "-m", "training.agent", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == BAD_INPUT, result.stderr[-2000:]
    assert f"CIFAR-10 data directory {tmp_path / 'nothing'} does not exist" in result.stderr
    assert "Starting elastic_operator" not in result.stderr  # it never joined a rendezvous


def test_an_eviction_ends_the_node_with_143(etcd_server: EmbeddedEtcd, tmp_path: Path) -> None:
    # Uncaught, torch's SignalException made the agent exit 1: under ExitCode the first
    # eviction would have failed the whole job for good. This also fails if a torch upgrade
    # stops raising SignalException (with its sigval) out of the elastic agent on SIGTERM.
    data = tmp_path / "data"
    write_synthetic_cifar10(data, train_records=240, test_records=24, seed=1)
    cluster = Cluster(tmp_path, etcd_server.client_port, data, min_nodes=1, max_nodes=1)
    try:
        cluster.start("a", [*TINY, "--max-steps", "100000", "--log-every", "1"])
        cluster.wait_until(lambda: cluster.max_step() >= 2, 120, "training to run")
        os.kill(cluster.nodes["a"].pid, signal.SIGTERM)  # the kubelet signals the container
        assert cluster.wait_exit("a", 60) == 143, cluster.tail()
    finally:
        cluster.close()


@pytest.mark.usefixtures("torchrun")
def test_an_etcd_outage_stops_the_workers_at_the_fence_and_loses_no_step(tmp_path: Path) -> None:
    # torch's handler raised a RendezvousConnectionError out of the agent's monitor loop as
    # soon as a heartbeat failed: every agent exited and came back cold (12-17 s paused).
    # Ours trains on through an outage shorter than the fence's window; past it, a node that
    # cannot renew its lease may have been left by the others, so its workers stop before
    # their next step (docs/rendezvous.md, "etcd away, and the fence"). Once etcd answers the
    # same nodes train on from their own saves: no agent exits, no step is lost.
    data = tmp_path / "data"
    write_synthetic_cifar10(data, train_records=240, test_records=24, seed=1)
    root = tmp_path / "etcd"
    with EmbeddedEtcd(find_etcd_binary(), root / "data", root / "etcd.log") as server:
        cluster = Cluster(tmp_path, server.client_port, data, min_nodes=2, max_nodes=2)
        args = [*TINY, "--max-steps", "100000", "--log-every", "1"]
        args += ["--min-step-time-s", "0.05", "--checkpoint-every-steps", "0"]
        try:
            for name in ("a", "b"):
                cluster.start(name, args)
            cluster.wait_until(lambda: cluster.max_step() >= 3, 120, "training to run")
            server.stop()
            # The first agent past its fence stops its workers; the other's lose their peer.
            cluster.wait_until(
                lambda: any("fenced" in (tmp_path / f"{n}.err").read_text() for n in "ab"),
                60,
                "an agent fenced",
            )
            server.start()
            back_at = cluster.max_step()
            cluster.wait_until(lambda: cluster.max_step() >= back_at + 5, 120, "steps, etcd back")
            assert all(cluster.nodes[n].poll() is None for n in ("a", "b")), cluster.tail()
            resumed = [r for r in cluster.records() if r.get("event") == RESUMED]
            assert len(resumed) == 2, cluster.tail()  # the first round's, and the fence's
            again = resumed[-1]
            assert (again["source"], again["world_size"]) == ("local", 2), again
            # Every step any node completed before the re-form is in the state it resumed.
            before = [
                step
                for r in cluster.records()
                if r["ts"] < again["ts"] and (step := completed_step(r)) is not None
            ]
            assert again["step"] == max(before), (again, max(before))
        finally:
            cluster.close()


def _steps_at_world(cluster: Cluster, world: int) -> list[dict]:
    """Metrics lines (rank 0 logs them) of steps trained at ``world`` ranks."""
    return [r for r in cluster.records() if r["kind"] == METRICS and r["world_size"] == world]


def _resumed(cluster: Cluster, node: str) -> list[dict]:
    return [r for r in cluster.records(node) if r.get("event") == RESUMED]


def test_restarts_spent_on_evictions_ask_for_a_new_pod_that_resumes_losing_nothing(
    etcd_server: EmbeddedEtcd, tmp_path: Path
) -> None:
    # Every eviction costs the survivors' agent a restart. Once the budget is spent the agent
    # used to exit 1 and close the rendezvous: the first few evictions ended the whole job.
    data = tmp_path / "data"
    write_synthetic_cifar10(data, train_records=240, test_records=24, seed=1)
    cluster = Cluster(
        tmp_path, etcd_server.client_port, data, min_nodes=1, max_nodes=2, max_restarts=1
    )
    args = [*TINY, "--max-steps", "100000", "--log-every", "1", "--checkpoint-every-steps", "0"]
    try:
        cluster.start("a", args)
        for peer in ("b", "c"):
            before = len(_steps_at_world(cluster, 2))
            cluster.start(peer, args)
            cluster.wait_until(
                lambda n=before: len(_steps_at_world(cluster, 2)) > n + 2, 120, f"{peer} to join"
            )
            cluster.kill(peer)  # an eviction without notice: a's workers lose their peer
        assert cluster.wait_exit("a", 120) == RETRY_ME, cluster.tail()
        assert "a new pod with a fresh budget joins" in (tmp_path / "a.err").read_text()
        logged = max(r["step"] for r in cluster.records("a") if r["kind"] == METRICS)
        saves = [r for r in cluster.records("a") if r.get("event") == EMERGENCY_SAVE]
        # a's last round committed its state durably, since a new pod's disk is empty: the
        # step it completed last (its log line may have been cut by the failure).
        assert saves[-1]["durable"] is True and saves[-1]["step"] >= logged, saves[-1]
        # The operator's new pod: the rendezvous is still open, and nothing is lost.
        cluster.start("d", args)
        cluster.wait_until(lambda: bool(_resumed(cluster, "d")), 120, "d to resume")
        (resumed,) = _resumed(cluster, "d")
        assert (resumed["source"], resumed["step"]) == ("durable", saves[-1]["step"]), resumed
    finally:
        cluster.close()


def test_bad_input_found_after_joining_stops_the_node_without_restarts(
    etcd_server: EmbeddedEtcd, tmp_path: Path
) -> None:
    # A checkpoint of another run is found only after joining (the ranks agree on it first).
    # It fails every round the same way: the node must stop at once with 2, not spend its
    # twenty restarts and then exit 1.
    data = tmp_path / "data"
    write_synthetic_cifar10(data, train_records=240, test_records=24, seed=1)
    first = Cluster(tmp_path, etcd_server.client_port, data, min_nodes=1, max_nodes=1)
    try:
        first.start("a", [*TINY, "--max-steps", "2"])
        assert first.wait_exit("a", 120) == 0, first.tail()
    finally:
        first.close()
    second = Cluster(tmp_path, etcd_server.client_port, data, min_nodes=1, max_nodes=1)
    try:
        # Another seed: another sample order, so the saved step means other samples.
        second.start("b", [*TINY, "--max-steps", "4", "--seed", "5"])
        assert second.wait_exit("b", 120) == BAD_INPUT, second.tail()
        err = (tmp_path / "b.err").read_text()
        assert "this run has seed=5" in err
        assert "stopping without another restart" in err
        assert len([r for r in second.records("b") if r.get("event") == STARTED]) == 1
    finally:
        second.close()


def test_the_docs_table_is_the_code_table() -> None:
    text = (REPO / "docs" / "training.md").read_text()
    table = text[text.index("| how the node ends | code |") :].split("\n\n")[0]
    rows = [line.split(" | ") for line in table.splitlines()[2:]]
    assert [(r[0].lstrip("| "), int(r[1])) for r in rows] == [(e.how, e.code) for e in ENDINGS]


def _failure(exitcode: int) -> object:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    return ProcessFailure(local_rank=0, pid=1, exitcode=exitcode, error_file="/nonexistent")


def _raises(exc: BaseException):
    def launch(args: list[str], handlers: list | None = None) -> None:
        raise exc

    return launch


@pytest.mark.parametrize(
    ("make", "code", "closes"),
    [
        (lambda: None, 0, True),
        (lambda: _signal(signal.SIGTERM), 143, False),
        (lambda: _signal(signal.SIGINT), 130, False),
        (lambda: ValueError("--lr must be > 0"), BAD_INPUT, False),
        (lambda: _bad_input_after_join(), BAD_INPUT, True),
        (lambda: _child_failed([WORKER_RESTART, WORKER_RESTART]), RETRY_ME, False),
        (lambda: _child_failed([WORKER_RESTART, RETRY_ME]), RETRY_ME, False),
        (lambda: _child_failed([1, WORKER_RESTART]), PERMANENT, True),
        (lambda: _rendezvous("RendezvousTimeoutError"), PERMANENT, True),
        (lambda: _reform_timeout(), RETRY_ME, False),
        (lambda: _rendezvous("RendezvousClosedError"), PERMANENT, False),
        (lambda: RunFinishedError("test"), 0, False),
        (lambda: RunFailedError("test"), PERMANENT, False),
        (lambda: _rendezvous("RendezvousConnectionError"), RETRY_ME, False),
        (lambda: _launcher_unusable(), BAD_INPUT, False),
        (lambda: _device_fault(), RETRY_ME, False),
        (lambda: _child_failed([DEVICE_FAULT, WORKER_RESTART]), RETRY_ME, False),
        (lambda: _left_the_rendezvous(), RETRY_ME, False),
    ],
    ids=[
        "finished",
        "sigterm",
        "sigint",
        "bad-flag",
        "bad-input-after-join",
        "spent-on-evictions",
        "spent-on-evictions-commit-gave-up",
        "spent-on-a-crash",
        "first-round-timeout",
        "later-round-timeout",
        "closed-with-no-reason",
        "closed-as-finished",
        "closed-as-failed-for-good",
        "etcd-outage",
        "launcher-unusable",
        "device-fault",
        "device-fault-in-the-last-round",
        "left-the-rendezvous",
    ],
)
def test_each_ending_is_its_code_and_closes_the_rendezvous_only_when_over(
    monkeypatch: pytest.MonkeyPatch, make, code: int, closes: bool
) -> None:
    from training import agent, launcher

    exc = make()
    monkeypatch.setattr(
        launcher, "launch", (lambda args, handlers=None: None) if exc is None else _raises(exc)
    )
    assert agent._launch_warm([]) == (code, closes)


@pytest.mark.parametrize("closing_code", [0, BAD_INPUT, PERMANENT])
def test_a_late_node_exits_0_only_when_the_run_closed_as_finished(closing_code: int) -> None:
    """The reason an agent records as it closes the run (from its own code, ``run_warm``) is
    what a node that starts later reads: only a finished run lets it exit 0, since its exit 1
    could fail the finished job (tests/training/test_late_join.py cites the operator)."""
    from torch.distributed.elastic.rendezvous import RendezvousClosedError

    from training import agent
    from training.elastic.closing import closed_error, closed_value

    state = closed_value({"round": 3, "members": ["a", "b"]}, why(closing_code))
    late = agent._ending(closed_error("run", state))
    assert late == ((0, False) if closing_code == 0 else (PERMANENT, False))
    # The first agent's reason stays; a key closed with no reason reads as before: exit 1.
    assert closed_value({"closed": FAILED}, FINISHED)["closed"] == FAILED
    assert type(closed_error("run", {"closed": True})) is RendezvousClosedError
    assert agent._ending(closed_error("run", {"closed": True})) == (PERMANENT, False)


def _signal(sig: signal.Signals) -> BaseException:
    from torch.distributed.elastic.multiprocessing import SignalException

    return SignalException(f"Process got signal: {sig}", sigval=sig)


def _bad_input_after_join() -> BaseException:
    return BadInputAfterJoin("a worker stopped on input no restart fixes")


def _child_failed(codes: list[int]) -> BaseException:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    return ChildFailedError("training.train", {i: _failure(c) for i, c in enumerate(codes)})


def _rendezvous(name: str) -> BaseException:
    from torch.distributed.elastic.rendezvous import api

    return getattr(api, name)("test")


def _reform_timeout() -> BaseException:
    from training.elastic.rendezvous import ReformTimeoutError

    return ReformTimeoutError("round 4 did not complete")


def _launcher_unusable() -> BaseException:
    from training.launcher import LauncherError

    return LauncherError("the fork server could not import training.train")


def _device_fault() -> BaseException:
    from training.launcher import DeviceFault

    return DeviceFault("a worker's GPU failed (local rank 0)")


def _left_the_rendezvous() -> BaseException:
    from torch.distributed.elastic.rendezvous import RendezvousGracefulExitError

    return RendezvousGracefulExitError("node a has left run-1")
