"""What training-operator v1.9.4 does with the job's pods as they exit, and what bounds it.

The operator's rules are transcribed from its source (cited on ``operator_after_exit``) and applied
to the manifest the builder makes, the way ``tests/workloads/test_workloads_program.py`` checks the
operator's HPA.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.workload_specs import _job_spec
from workloads.manifests.job import pytorchjob_manifest

# ---- what the operator does with a pod that keeps crashing ---------------------------------------


def operator_after_exit(
    manifest: dict[str, Any], exit_code: int, started_s: float, now_s: float
) -> str:
    """What training-operator v1.9.4 does when a worker container exits with ``exit_code``,
    ``now_s - started_s`` seconds after the job started, transcribed from its source:

    - ``pkg/controller.v1/common/job.go``: ``PastActiveDeadline`` (runPolicy set and
      now - status.startTime >= activeDeadlineSeconds) is checked first; past it the job fails
      and its pods are deleted, whatever they do;
    - ``pkg/util/train/train_util.go``: ``IsRetryableExitCode`` is ``exitCode >= 128``; under
      restartPolicy ExitCode a retryable exit gets a new pod, any other fails the job.
    """
    deadline = manifest["spec"]["runPolicy"].get("activeDeadlineSeconds")
    if deadline is not None and now_s - started_s >= deadline:
        return "failed: deadline exceeded"
    worker = manifest["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert worker["restartPolicy"] == "ExitCode"
    if exit_code == 0:
        return "succeeded"
    return "new pod" if exit_code >= 128 else "failed: permanent exit"


@pytest.mark.parametrize("signal_exit", [134, 139])
def test_a_pod_that_keeps_crashing_by_a_signal_is_retried_until_the_deadline(
    signal_exit: int,
) -> None:
    """SIGABRT (134) and SIGSEGV (139) are >= 128, so the operator retries them like an
    eviction: with no deadline, a crash loop runs on billed GPU nodes forever."""
    unbounded = pytorchjob_manifest(_job_spec())
    assert "activeDeadlineSeconds" not in unbounded["spec"]["runPolicy"]
    day = 24 * 3600
    # A crash every 2 minutes, for a week: retried every time.
    assert {operator_after_exit(unbounded, signal_exit, 0, t) for t in range(0, 7 * day, 120)} == {
        "new pod"
    }
    bounded = pytorchjob_manifest(_job_spec(active_deadline_s=day))
    outcomes = [operator_after_exit(bounded, signal_exit, 0, t) for t in range(0, 7 * day, 120)]
    first_failure = outcomes.index("failed: deadline exceeded")
    assert set(outcomes[:first_failure]) == {"new pod"}
    assert first_failure * 120 == day  # the crash at the deadline ends the job
    assert set(outcomes[first_failure:]) == {"failed: deadline exceeded"}


def test_bad_input_fails_the_job_at_once_and_an_eviction_is_retried() -> None:
    manifest = pytorchjob_manifest(_job_spec())
    assert operator_after_exit(manifest, 2, 0, 60) == "failed: permanent exit"
    assert operator_after_exit(manifest, 143, 0, 60) == "new pod"
    assert operator_after_exit(manifest, 138, 0, 60) == "new pod"
