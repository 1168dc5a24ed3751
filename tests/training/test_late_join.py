"""A node that starts after its run ended: a finished run is nothing to do (exit 0), a run that
failed for good stays failed (exit 1).

Why a late node must not exit 1 when the run finished. training-operator v1.9.x (branch
release-1.9; these files are unchanged since tag v1.9.0) computes a PyTorchJob's conditions in
one reconcile, ``ReconcileJobs`` in pkg/controller.v1/common/job.go, in this order:

- line 122: a job already Succeeded or Failed is left alone (``IsFinished``);
- line 339: ``ReconcilePods``, pkg/controller.v1/common/pod.go lines 350-373: a pod in phase
  Failed whose exit code is not retryable under ``restartPolicy: ExitCode`` sets the job's
  condition ``Failed`` (``Pod ... has a non-retryable exit code. Failing job.``);
- line 354: ``UpdateJobStatus``, pkg/controller.v1/pytorch/pytorchjob_controller.go line 409:
  with an ``elasticPolicy``, any worker Succeeded sets ``Succeeded`` (added by kubeflow/trainer
  PR #1752 for issue #1751: a worker scheduled only after the others had succeeded);
- pkg/util/status.go lines 104-107, ``setCondition``: once ``Failed`` is set, no condition is
  set after it ("Do nothing if JobStatus have failed condition").

So a late pod that exits 1 before the operator has marked the job Succeeded (a replacement pod
scheduled as training ended, a slow cold start) fails a run whose every other worker exited 0:
the reconcile that sees both sets Failed first, and Succeeded is then ignored. Once the job is
Succeeded, a late exit changes nothing (line 122), but the race is the agent's to avoid.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lab.local.etcd_server import EmbeddedEtcd
from tests.support.elastic_cluster import TINY, Cluster
from training.data.cifar10 import write_synthetic_cifar10
from training.elastic.launch import RendezvousSettings

pytestmark = pytest.mark.usefixtures("torchrun")

FINISHED_LINE = "the run finished before this node joined: nothing to do"


@pytest.fixture
def data(tmp_path: Path) -> Path:
    root = tmp_path / "data"
    write_synthetic_cifar10(root, train_records=240, test_records=24, seed=1)
    return root


def _log(cluster: Cluster, name: str) -> str:
    return (cluster.root / f"{name}.err").read_text()


@pytest.mark.timeout(300)
def test_a_node_that_starts_after_the_run_finished_exits_0(
    etcd_server: EmbeddedEtcd, data: Path, tmp_path: Path
) -> None:
    """Two nodes finish the run; a third with the same run id finds it finished and exits 0,
    not 1, which training-operator v1.9.x would take as the job's failure (module docstring)."""
    cluster = Cluster(tmp_path, etcd_server.client_port, data, min_nodes=2, max_nodes=3)
    args = [*TINY, "--max-steps", "6", "--log-every", "1"]
    try:
        for name in ("a", "b"):
            cluster.start(name, args)
        for name in ("a", "b"):
            assert cluster.wait_exit(name, 240) == 0, cluster.tail()
        cluster.start("late", args)
        assert cluster.wait_exit("late", 120) == 0, cluster.tail()
        log = _log(cluster, "late")
        assert log.count(FINISHED_LINE) == 1, log
        assert not cluster.records("late"), "the late node trained"  # no worker started
    finally:
        cluster.close()


@pytest.mark.timeout(300)
def test_a_node_that_starts_after_the_run_failed_for_good_still_exits_1(
    etcd_server: EmbeddedEtcd, data: Path, tmp_path: Path
) -> None:
    """The first round times out with too few nodes (capacity or quota): the run is closed for
    good, and a node that comes later must fail the job too (exit 1), not pass for finished."""
    short = RendezvousSettings(join_timeout_s=3)
    cluster = Cluster(
        tmp_path, etcd_server.client_port, data, min_nodes=2, max_nodes=2, rendezvous=short
    )
    args = [*TINY, "--max-steps", "6"]
    try:
        cluster.start("alone", args)
        assert cluster.wait_exit("alone", 120) == 1, cluster.tail()
        assert "too few nodes joined in time" in _log(cluster, "alone")
        cluster.start("late", args)
        assert cluster.wait_exit("late", 120) == 1, cluster.tail()
        log = _log(cluster, "late")
        assert "the run failed for good before this node joined" in log, log
        assert FINISHED_LINE not in log
    finally:
        cluster.close()
