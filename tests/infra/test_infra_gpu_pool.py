"""Changes to the GPU pool strand nothing: new bounds apply to the pool as it is, and a new pool
generation takes the job with it before the old one goes.

What AKS and pulumi-azure-native do with an autoscaled pool's ``count``, from their sources:

- azure-native sends every input of an AgentPool on each create and update (a PUT of the whole
  agent pool); ``count`` is required on create (pulumi-azure-native #2943, "Required parameter
  properties.count is missing"), and on create AKS refuses a count outside [minCount, maxCount]
  (its message, quoted in cluster-api-provider-azure #5947).
- A count that differs from the pool's current one on an autoscaled pool is a manual scale,
  which AKS refuses ("Cannot manually scale AgentPool ... with cluster autoscaler enabled",
  terraform-provider-azurerm #4543, which therefore sends the count read from the pool).
- ``az aks nodepool update --update-cluster-autoscaler`` reads the pool and writes it back with
  its current count and the new bounds. Its check that the current count lies within the new
  range (the error of Azure/AKS #1481) was the CLI's own and was removed (azure-cli-extensions
  #1606: "minCount can be greater than the actual node count"); Azure/AKS #1758: unblocked in
  ARM as well; AKS release 2021-07-22: the autoscaler then enforces a raised minimum.

So the plan AKS accepts keeps the pool's current count and changes only the bounds
(``infra.node_pools.gpu_pool_count``). Before, the count was fixed at the creation-time
gpuMinNodes and sent on every update whatever the pool had scaled to.
"""

from __future__ import annotations

import pytest

from infra.node_pools import gpu_pool_count, live_pool_count
from tests.support.pulumi_harness import AzureAnswers, ProgramRun, Registered, run_program

AGENT_POOL = "azure-native:containerservice:AgentPool"
PYTORCHJOB = "kubernetes:kubeflow.org/v1:PyTorchJob"


def _pool(run: ProgramRun) -> Registered:
    return run.one(AGENT_POOL, "gpu-spot")


def _current_name() -> str:
    return _pool(run_program("dev")).inputs["agentPoolName"]


@pytest.mark.parametrize("running", [0, 3])
def test_raising_gpu_min_nodes_keeps_the_pools_count_and_raises_the_floor(running: int) -> None:
    """gpuMinNodes 0 -> 2, with the pool idle (0 nodes) or training on 3."""
    answers = AzureAnswers(live_pool_counts={_current_name(): running})
    before = _pool(run_program("dev", answers=answers)).inputs
    after = _pool(run_program("dev", {"gpuMinNodes": "2"}, answers=answers)).inputs
    assert after["agentPoolName"] == before["agentPoolName"]  # an update, not a new pool
    assert (before["minCount"], after["minCount"]) == (0, 2)
    # The PUT carries the count the pool has now: no manual scale, no node taken away; the
    # autoscaler brings an idle pool up to the new floor.
    assert before["count"] == after["count"] == running
    assert after["enableAutoScaling"] is True


@pytest.mark.parametrize(("running", "new_max"), [(0, "5"), (3, "5"), (2, "3")])
def test_changing_gpu_max_nodes_keeps_the_pools_count(running: int, new_max: str) -> None:
    answers = AzureAnswers(live_pool_counts={_current_name(): running})
    overrides = {"gpuMaxNodes": new_max}
    after = _pool(run_program("dev", overrides, answers=answers)).inputs
    assert after["maxCount"] == int(new_max)
    assert after["count"] == running
    assert after["minCount"] <= after["maxCount"]


def test_a_new_pool_is_created_with_gpu_min_nodes() -> None:
    # No pool of that name in the cluster yet (first up, or a new generation).
    run = run_program("dev", {"gpuMinNodes": "1"})
    pool = _pool(run).inputs
    assert pool["count"] == pool["minCount"] == 1
    (call,) = run.calls_to("azure-native:containerservice:getManagedCluster")
    assert call.args["resourceName"] == run.outputs["clusterName"]
    assert call.args["resourceGroupName"] == run.outputs["resourceGroup"]


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


def test_the_live_count_is_read_from_the_clusters_pools() -> None:
    profiles = [{"name": "bootstrap", "count": 1}, {"name": "gpu1a2b3c4d", "count": 3}]
    assert live_pool_count(profiles, "gpu1a2b3c4d") == 3
    assert live_pool_count(profiles, "gpu99999999") is None
    assert live_pool_count(None, "gpu1a2b3c4d") is None
    assert gpu_pool_count(None, 2) == 2
    assert gpu_pool_count(0, 2) == 0
