"""Changes to the GPU pool strand nothing: an `up` leaves the autoscaler's node count alone, new
bounds apply to the pool as it is, and a new pool generation takes the job with it before the
old one goes.

What AKS, Pulumi and pulumi-azure-native do with an autoscaled pool's ``count``, from their
sources (``infra.node_pools.AUTOSCALED_COUNT``):

- ``count`` is required on create (pulumi-azure-native #2943), and AKS refuses one outside
  [minCount, maxCount] then (its message, quoted in cluster-api-provider-azure #5947).
- A PUT of the pool while the autoscaler scales it is refused ("Another operation (Scaling) is
  in progress", Azure/AKS #1561), and one that succeeds leaves the pool Updating for minutes.
  Reading the live count into the program made every `up` after a scale plan ``~ count``.
- ``ignoreChanges``: the engine "replaces the values of input properties in the goal state with
  old inputs for properties marked as ignoreChanges" (pulumi/pulumi #2657), and uses the
  program's value when the state has none, "most importantly when creating the resource"
  (Pulumi docs). ``planned_changes`` reproduces that comparison.
"""

from __future__ import annotations

import pytest

from tests.support.pulumi_harness import (
    AzureAnswers,
    ProgramRun,
    Registered,
    planned_changes,
    run_program,
)

AGENT_POOL = "azure-native:containerservice:AgentPool"
PYTORCHJOB = "kubernetes:kubeflow.org/v1:PyTorchJob"


def _pool(run: ProgramRun) -> Registered:
    return run.one(AGENT_POOL, "gpu-spot")


def _current_name() -> str:
    return _pool(run_program("dev")).inputs["agentPoolName"]


@pytest.mark.parametrize("running", [0, 3, 5])
def test_a_second_up_after_the_autoscaler_moved_the_pool_plans_no_pool_update(
    running: int,
) -> None:
    """The first `up` created the pool at gpuMinNodes; the autoscaler then moved it."""
    created = _pool(run_program("dev"))
    answers = AzureAnswers(live_pool_counts={created.inputs["agentPoolName"]: running})
    again = _pool(run_program("dev", answers=answers))
    assert planned_changes(created, again) == []


@pytest.mark.parametrize(
    ("overrides", "changed"),
    [
        ({"gpuMinNodes": "2"}, ["minCount"]),
        ({"gpuMaxNodes": "5"}, ["maxCount"]),
        ({"gpuMaxNodes": "4"}, ["maxCount"]),
    ],
)
def test_a_change_of_bounds_updates_the_bounds_and_never_the_count(
    overrides: dict[str, str], changed: list[str]
) -> None:
    created = _pool(run_program("dev"))
    answers = AzureAnswers(live_pool_counts={created.inputs["agentPoolName"]: 3})
    updated = _pool(run_program("dev", overrides, answers=answers))
    assert updated.inputs["agentPoolName"] == created.inputs["agentPoolName"]  # not a new pool
    assert planned_changes(created, updated) == changed
    assert updated.inputs["enableAutoScaling"] is True


def test_a_new_pool_is_created_with_gpu_min_nodes() -> None:
    # No pool of that name in the cluster yet (first up, or a new generation).
    run = run_program("dev", {"gpuMinNodes": "1"})
    pool = _pool(run)
    assert pool.inputs["count"] == pool.inputs["minCount"] == 1
    # The program's count is what a create carries; after that the state's is kept.
    assert pool.ignore_changes == ["count"]


def test_t4_to_a100_is_a_new_pool_the_job_follows_and_the_old_one_goes_last() -> None:
    """gpuVmSize T4 -> A100: the size is create-only, so the new name makes a new pool, which
    Pulumi creates before it deletes the old one (no delete-before-replace). The new pool starts
    at gpuMinNodes (no pool of its name is running). The job selects the new generation's label
    and takes the pool's name as an input, so it is replaced after the new pool exists, and its
    workers can only land there; the old pool, deleted last, never gets a new worker."""
    old_name = _current_name()
    answers = AzureAnswers(live_pool_counts={old_name: 3})
    moved = run_program("dev", {"gpuVmSize": "Standard_NC24ads_A100_v4"}, answers=answers)
    pool = _pool(moved)
    assert pool.inputs["agentPoolName"] != old_name
    assert pool.delete_before_replace is False
    assert pool.inputs["count"] == pool.inputs["minCount"] == 0
    job = moved.one(PYTORCHJOB)
    selector = job.inputs["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    assert selector["nodeSelector"]["spot-lab/pool-generation"] == pool.inputs["agentPoolName"]
    assert old_name not in str(job.inputs)
    assert moved.waits_for(job, pool)
    # A new spec is a new job (same name: the old one is deleted first, with its workers).
    assert job.replace_on_changes == ["spec"] and job.delete_before_replace


def test_every_up_refreshes_first_so_a_pool_update_carries_the_live_count() -> None:
    """An update of another pool setting sends the count in Pulumi's state (ignoreChanges), and
    AKS refuses one that differs from the live count as a manual scale (terraform-provider-azurerm
    #4543); a refresh before every up records the live count (Pulumi.yaml's ``options.refresh:
    always``, pulumi/pulumi #8071: a string, not a boolean, pulumi-hugo #1971)."""
    import yaml

    from tests.support.pulumi_harness import PROJECT_DIR

    project = yaml.safe_load((PROJECT_DIR / "Pulumi.yaml").read_text())
    assert project["options"] == {"refresh": "always"}
