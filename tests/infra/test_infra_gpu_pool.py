"""Changes to the GPU pool strand nothing: an `up` leaves the autoscaler's node count alone, new
bounds and a new Kubernetes version reach the pool through `az aks nodepool` (which reads the live
pool), no `up` rewrites the cluster, and a new pool generation takes the job with it before the
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
- A refresh writes every pool of the cluster, the separate AgentPools with their live counts
  included, into the cluster's ``agentPoolProfiles`` (pulumi-azure-native #1532), and a cluster
  PUT with a changed list puts every pool into Scaling (#4264). ``_refreshed`` is that state.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.support.pulumi_harness import (
    AzureAnswers,
    ProgramRun,
    Registered,
    planned_changes,
    run_program,
)

AGENT_POOL = "azure-native:containerservice:AgentPool"
CLUSTER = "azure-native:containerservice:ManagedCluster"
COMMAND = "command:local:Command"
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


def _command(run: ProgramRun, name: str) -> Registered:
    return run.one(COMMAND, name)


@pytest.mark.parametrize(
    ("overrides", "bounds"),
    [
        ({"gpuMinNodes": "2"}, "--min-count 2 --max-count 3"),
        ({"gpuMaxNodes": "5"}, "--max-count 5"),
    ],
)
def test_new_bounds_go_through_az_which_keeps_the_live_count(
    overrides: dict[str, str], bounds: str
) -> None:
    """No PUT of the pool carries the count the state holds (the create's): the pool plans no
    update, and `az aks nodepool update --update-cluster-autoscaler` (a read of the live pool,
    then its PUT with the new bounds) runs as the command's update."""
    created = run_program("dev")
    answers = AzureAnswers(live_pool_counts={_pool(created).inputs["agentPoolName"]: 3})
    updated = run_program("dev", overrides, answers=answers)
    assert _pool(updated).inputs["agentPoolName"] == _pool(created).inputs["agentPoolName"]
    assert planned_changes(_pool(created), _pool(updated)) == []
    before, after = _command(created, "gpu-spot-bounds"), _command(updated, "gpu-spot-bounds")
    assert planned_changes(before, after) == ["triggers", "update"]
    assert after.inputs["update"].startswith("az aks nodepool update ")
    assert "--update-cluster-autoscaler" in after.inputs["update"]
    assert bounds in after.inputs["update"]
    assert f"--name {_pool(updated).inputs['agentPoolName']} " in after.inputs["update"]
    assert "--subscription " in after.inputs["update"]
    # Never on the pool's create: the autoscaler may be scaling the new pool already.
    assert after.inputs["create"] == "true"
    assert updated.waits_for(after, _pool(updated))


def test_a_new_pool_is_created_with_gpu_min_nodes() -> None:
    # No pool of that name in the cluster yet (first up, or a new generation).
    run = run_program("dev", {"gpuMinNodes": "1"})
    pool = _pool(run)
    assert pool.inputs["count"] == pool.inputs["minCount"] == 1
    # The program's count is what a create carries; after that the state's is kept, and the
    # pool is never PUT again (bounds and version: `az aks nodepool`).
    assert pool.ignore_changes == ["count", "minCount", "maxCount", "orchestratorVersion"]


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


def _refreshed(cluster: Registered, counts: dict[str, int]) -> Registered:
    """The cluster's state after `pulumi refresh`: its inline list holds every pool of the
    cluster, with the live counts (pulumi-azure-native #1532)."""
    profiles = list(cluster.inputs["agentPoolProfiles"])
    profiles += [{"name": name, "count": count, "mode": "User"} for name, count in counts.items()]
    return replace(cluster, inputs={**cluster.inputs, "agentPoolProfiles": profiles})


@pytest.mark.parametrize(
    "overrides",
    [{}, {"gpuMinNodes": "1"}, {"workerMaxReplicas": "5"}, {"gpuVmSize": "Standard_NC8as_T4_v3"}],
)
@pytest.mark.parametrize("refreshed", [False, True])
def test_a_second_up_after_autoscaling_or_a_pool_change_plans_no_cluster_update(
    overrides: dict[str, str], refreshed: bool
) -> None:
    """The autoscaler moved the GPU pool to 3 nodes; then nothing changed, or a pool setting
    did. No `up` refreshes (Pulumi.yaml has no ``options.refresh``), and after a refresh by hand
    the inline list the refresh rewrote is ignored (``infra.cluster.INLINE_POOLS``)."""
    first = run_program("dev")
    live = {_pool(first).inputs["agentPoolName"]: 3}
    state = first.one(CLUSTER)
    if refreshed:
        state = _refreshed(state, live)
        assert planned_changes(state, replace(first.one(CLUSTER), ignore_changes=[]))
    again = run_program("dev", overrides, answers=AzureAnswers(live_pool_counts=live))
    assert planned_changes(state, again.one(CLUSTER)) == []


def test_no_up_refreshes_first() -> None:
    """A blanket refresh made every `up` after a pool change a PUT of the whole cluster."""
    import yaml

    from tests.support.pulumi_harness import PROJECT_DIR

    project = yaml.safe_load((PROJECT_DIR / "Pulumi.yaml").read_text())
    assert "refresh" not in (project.get("options") or {})


def test_a_kubernetes_version_change_upgrades_the_control_plane_then_every_pool() -> None:
    """With a Spot pool, AKS upgrades the control plane and the pools only one after the other
    (AKS, Spot node pools, Limitations). The cluster's PUT changes only kubernetesVersion (its
    inline pool keeps its version: INLINE_POOLS); each pool then follows after it: the system
    pool by its own PUT (its count is Pulumi's), the GPU pool and the inline bootstrap pool by
    `az aks nodepool upgrade`, which keeps the live count."""
    before = run_program("dev", {"kubernetesVersion": "1.33"})
    after = run_program("dev", {"kubernetesVersion": "1.34"})
    cluster = after.one(CLUSTER)
    assert planned_changes(before.one(CLUSTER), cluster) == ["kubernetesVersion"]
    system = after.one(AGENT_POOL, "cluster-system")
    assert planned_changes(before.one(AGENT_POOL, "cluster-system"), system) == [
        "orchestratorVersion"
    ]
    assert after.waits_for(system, cluster)
    assert planned_changes(_pool(before), _pool(after)) == []
    for name, pool in (
        ("gpu-spot-version", _pool(after).inputs["agentPoolName"]),
        ("bootstrap-version", "bootstrap"),
    ):
        upgrade = _command(after, name)
        assert planned_changes(_command(before, name), upgrade) == ["triggers", "update"]
        assert upgrade.inputs["update"].startswith("az aks nodepool upgrade ")
        assert f"--name {pool} " in upgrade.inputs["update"]
        assert "--kubernetes-version 1.34 --yes" in upgrade.inputs["update"]
        assert after.waits_for(upgrade, cluster)
