"""The on-demand fallback under mocks: with ``onDemandMaxNodes`` the job may grow onto a regular
pool of the GPU size, which the cluster autoscaler uses only after the Spot pool; without it the
plan is exactly today's.

What AKS's managed autoscaler honours, from its sources (cited again at the code):

- ``autoScalerProfile.expander`` takes ``priority`` (REST spec ``ManagedClusterAutoScalerProfile``
  and pulumi-azure-native's ``Expander.PRIORITY``: "Selects the node group that has the highest
  priority assigned by the user", configured per the autoscaler's priority readme; AKS docs
  "Use the cluster autoscaler in AKS": ``expander`` values ``most-pods``, ``random``,
  ``least-waste`` and ``priority``; AKS CHANGELOG 2021-01-04: the profile "now exposes the
  max-node-provision-time and priority properties"; 2021-06-03: the priority expander no longer
  falls back "to a random choice when a higher priority exists", Azure/AKS issue 2359).
- ``maxNodeProvisionTime`` is whole minutes ("an integer followed by an 'm'", REST spec); after
  it an unregistered scale-up times out (``ScaleUpTimedOut``), the group backs off and the
  autoscaler "may attempt to scale up a different group if the pods are still pending"
  (kubernetes/autoscaler ``cluster-autoscaler/FAQ.md``; ``clusterstate/clusterstate.go``).
- The priorities are the ``cluster-autoscaler-priority-expander`` ConfigMap's ``priorities`` key in
  the autoscaler's namespace, ``kube-system``: YAML ``map[int][]string`` of regexes matched,
  unanchored, against node group ids, "the highest value wins"
  (``cluster-autoscaler/expander/priority/readme.md`` and ``priority.go``); on AKS a node group id
  is the pool's scale set name ``aks-<pool>-<digits>-vmss`` (``cloudprovider/azure/
  azure_scale_set.go``, ``Id()``; kubernetes/autoscaler PR 1896).
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml

from tests.support.pulumi_harness import AzureAnswers, ProgramRun, planned_changes, run_program

AGENT_POOL = "azure-native:containerservice:AgentPool"
COMMAND = "command:local:Command"
CLUSTER = "azure-native:containerservice:ManagedCluster"
CONFIG_MAP = "kubernetes:core/v1:ConfigMap"
DAEMONSET = "kubernetes:apps/v1:DaemonSet"
PYTORCHJOB = "kubernetes:kubeflow.org/v1:PyTorchJob"
PROVIDER = "pulumi:providers:kubernetes"
# The first round must outlast 10 min for Spot plus 600 s for an on-demand VM (stack_config).
ON = {"onDemandMaxNodes": "2", "rdzvJoinTimeout": "1200"}


@pytest.fixture(scope="module")
def on() -> ProgramRun:
    return run_program("dev", ON)


@pytest.fixture(scope="module")
def off() -> ProgramRun:
    return run_program("dev")


def _pools(run: ProgramRun) -> tuple[dict[str, Any], dict[str, Any]]:
    return run.one(AGENT_POOL, "gpu-spot").inputs, run.one(AGENT_POOL, "gpu-on-demand").inputs


def _worker(run: ProgramRun) -> dict[str, Any]:
    job = run.one(PYTORCHJOB).inputs
    return job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]


def _selected(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def _term_matches(term: dict[str, Any], labels: dict[str, str]) -> bool:
    """A node selector term's ``In`` expressions, as the scheduler reads them."""
    return all(labels.get(e["key"]) in e["values"] for e in term["matchExpressions"])


def _tolerated(tolerations: list[dict[str, Any]], taints: list[str]) -> bool:
    """Every ``key=value:effect`` taint has a toleration (Equal on the value, or Exists)."""

    def covered(taint: str) -> bool:
        key, _, rest = taint.partition("=")
        value, _, effect = rest.partition(":")
        return any(
            t["key"] == key
            and t.get("effect") in (None, effect)
            and (t["operator"] == "Exists" or t.get("value") == value)
            for t in tolerations
        )

    return all(covered(taint) for taint in taints)


def _scale_set(pool: str) -> str:
    """AKS's name for a pool's scale set: the autoscaler's node group id."""
    return f"aks-{pool}-12345678-vmss"


def _best_group(priorities: dict[int, list[str]], groups: list[str]) -> list[str]:
    """What ``priority.go``'s ``BestOption`` keeps: the groups at the highest matching priority
    (RE2's unanchored search is ``re.search`` for these patterns)."""
    matched = {
        group: max((p for p, res in priorities.items() if any(re.search(r, group) for r in res)))
        for group in groups
    }
    top = max(matched.values())
    return [group for group, priority in matched.items() if priority == top]


def test_a_regular_priority_pool_of_the_gpu_size_from_zero_to_on_demand_max_nodes(
    on: ProgramRun,
) -> None:
    spot, on_demand = _pools(on)
    assert on_demand["scaleSetPriority"] == "Regular"
    assert on_demand["vmSize"] == spot["vmSize"] == "Standard_NC4as_T4_v3"
    assert (on_demand["enableAutoScaling"], on_demand["minCount"]) == (True, 0)
    assert on_demand["maxCount"] == 2 and on_demand["count"] == 0
    assert on_demand["gpuProfile"] == {"driver": "Install"}
    # AKS taints Spot nodes only: the fallback's nodes carry just the GPU taint.
    assert on_demand["nodeTaints"] == ["nvidia.com/gpu=present:NoSchedule"]
    assert "scaleSetEvictionPolicy" not in on_demand and "spotMaxPrice" not in on_demand
    assert re.fullmatch(r"ond[0-9a-f]{8}", on_demand["agentPoolName"])
    # The Spot pool's generation: the job's selector finds both pools by it.
    assert on_demand["nodeLabels"] == {
        "spot-lab/pool": "gpu-on-demand",
        "spot-lab/pool-generation": spot["agentPoolName"],
    }
    assert on.outputs["onDemandPoolName"] == on_demand["agentPoolName"]
    pool = on.one(AGENT_POOL, "gpu-on-demand")
    assert set(pool.replace_on_changes) == {
        "vmSize",
        "scaleSetPriority",
        "gpuProfile",
        "osType",
        "type",
    }


def test_the_autoscaler_prefers_the_spot_pool_through_the_priority_expander(on: ProgramRun) -> None:
    profile = on.one(CLUSTER).inputs["autoScalerProfile"]
    assert profile["expander"] == "priority"
    assert profile["maxNodeProvisionTime"] == "10m"  # AKS: whole minutes only
    config_map = on.one(CONFIG_MAP, "autoscaler-priorities").inputs
    assert config_map["metadata"]["name"] == "cluster-autoscaler-priority-expander"
    assert config_map["metadata"]["namespace"] == "kube-system"
    priorities = yaml.safe_load(config_map["data"]["priorities"])
    # map[int][]string, as the expander's YAML parser wants it.
    assert all(type(p) is int and isinstance(res, list) for p, res in priorities.items())
    spot, on_demand = _pools(on)
    spot_set, on_demand_set = (
        _scale_set(spot["agentPoolName"]),
        _scale_set(on_demand["agentPoolName"]),
    )
    assert _best_group(priorities, [spot_set, on_demand_set]) == [spot_set]
    # Once the Spot pool backs off it is no option, and the on-demand pool is the best left.
    system = _scale_set(on.one(AGENT_POOL, "system").inputs["agentPoolName"])
    assert _best_group(priorities, [on_demand_set, system]) == [on_demand_set]
    # Every group matches some entry: none is dropped as "not found in priority expander
    # configuration" (priority.go), the CPU pool and any pool a user adds included.
    assert _best_group(priorities, [system]) == [system]
    # No pool scales while the ConfigMap is missing (BestOption returns nil): it comes first.
    assert on.waits_for(on.one(PYTORCHJOB), on.one(CONFIG_MAP, "autoscaler-priorities"))


def test_the_spot_wait_follows_the_stack() -> None:
    run = run_program("dev", {**ON, "fallbackAfterMinutes": "6", "rdzvJoinTimeout": "960"})
    assert run.one(CLUSTER).inputs["autoScalerProfile"]["maxNodeProvisionTime"] == "6m"


def test_workers_prefer_spot_and_may_run_on_either_pool_of_their_generation(
    on: ProgramRun,
) -> None:
    spot, on_demand = _pools(on)
    worker = _worker(on)
    for pool in (spot, on_demand):
        assert _selected(worker["nodeSelector"], pool["nodeLabels"]), pool["agentPoolName"]
        assert _tolerated(worker["tolerations"], pool["nodeTaints"]), pool["agentPoolName"]
    node_affinity = worker["affinity"]["nodeAffinity"]
    (preferred,) = node_affinity["preferredDuringSchedulingIgnoredDuringExecution"]
    assert preferred["weight"] == 100
    assert _term_matches(preferred["preference"], spot["nodeLabels"])
    assert not _term_matches(preferred["preference"], on_demand["nodeLabels"])
    # Only the GPU pools of this generation: never the CPU pool, never an old generation.
    system = on.one(AGENT_POOL, "system").inputs["nodeLabels"]
    assert not _selected(worker["nodeSelector"], system)
    old = {**spot["nodeLabels"], "spot-lab/pool-generation": "gpu00000000"}
    assert not _selected(worker["nodeSelector"], old)


def test_the_device_plugin_runs_on_both_gpu_pools(on: ProgramRun) -> None:
    plugin = on.one(DAEMONSET, "device-plugin").inputs["spec"]["template"]["spec"]
    (term,) = plugin["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    for pool in _pools(on):
        assert _term_matches(term, pool["nodeLabels"]) and "nodeSelector" not in plugin
        assert _tolerated(plugin["tolerations"], pool["nodeTaints"])
    assert not _term_matches(term, on.one(AGENT_POOL, "system").inputs["nodeLabels"])


def test_the_workloads_wait_for_the_fallback_pool_and_go_before_it(on: ProgramRun) -> None:
    provider = on.one(PROVIDER)
    assert on.waits_for(provider, on.one(AGENT_POOL, "gpu-on-demand"))


def test_a_size_change_replaces_both_pools_and_the_job_follows_the_new_generation(
    on: ProgramRun,
) -> None:
    spot, on_demand = _pools(on)
    a100 = {**ON, "gpuVmSize": "Standard_NC24ads_A100_v4"}
    run = run_program("dev", a100)
    new_spot, new_on_demand = _pools(run)
    assert new_spot["agentPoolName"] != spot["agentPoolName"]
    assert new_on_demand["agentPoolName"] != on_demand["agentPoolName"]
    assert new_on_demand["vmSize"] == "Standard_NC24ads_A100_v4"
    assert new_on_demand["nodeLabels"]["spot-lab/pool-generation"] == new_spot["agentPoolName"]
    assert _worker(run)["nodeSelector"] == {"spot-lab/pool-generation": new_spot["agentPoolName"]}
    # A new Spot price is a new Spot pool: the fallback follows it too.
    priced = _pools(run_program("dev", {**ON, "spotMaxPrice": "0.2"}))
    assert priced[1]["nodeLabels"]["spot-lab/pool-generation"] == priced[0]["agentPoolName"]
    assert priced[1]["agentPoolName"] != on_demand["agentPoolName"]


def test_the_fallback_pools_count_is_the_autoscalers(on: ProgramRun) -> None:
    """Like the Spot pool's (tests/infra/test_infra_gpu_pool.py): a count the autoscaler moved
    plans nothing, and a new ceiling goes through `az aks nodepool update`, never a PUT of the
    pool with the count of its create."""
    created = on.one(AGENT_POOL, "gpu-on-demand")
    answers = AzureAnswers(live_pool_counts={created.inputs["agentPoolName"]: 2})
    again = run_program("dev", ON, answers=answers).one(AGENT_POOL, "gpu-on-demand")
    assert planned_changes(created, again) == []
    raised = run_program("dev", {**ON, "onDemandMaxNodes": "3"}, answers=answers)
    assert planned_changes(created, raised.one(AGENT_POOL, "gpu-on-demand")) == []
    bounds = raised.one(COMMAND, "gpu-on-demand-bounds").inputs["update"]
    assert f"--name {created.inputs['agentPoolName']} " in bounds
    assert "--update-cluster-autoscaler --min-count 0 --max-count 3" in bounds


# ---- off: today's plan ----------------------------------------------------------------------


def _plan(run: ProgramRun) -> dict[str, Any]:
    """Every custom resource with what a preview compares, and the stack outputs."""
    resources = {
        f"{r.type}::{r.name}": (r.inputs, sorted(r.dependencies), r.replace_on_changes)
        for r in run.resources
        if r.custom
    }
    return {"resources": resources, "outputs": run.outputs}


def test_zero_is_the_default_and_changes_nothing(off: ProgramRun) -> None:
    assert _plan(run_program("dev", {"onDemandMaxNodes": "0"})) == _plan(off)


def test_off_the_plan_is_todays(off: ProgramRun) -> None:
    """The values this program registered before the fallback existed, for the parts the
    fallback touches: with it off an existing stack sees no change."""
    assert off.one(CLUSTER).inputs["autoScalerProfile"] == {
        "expander": "least-waste",
        "scaleDownDelayAfterAdd": "5m",
        "scaleDownUnneededTime": "5m",
        "skipNodesWithLocalStorage": "false",
        # For every stack, the fallback on or off: the most GPU nodes the config allows
        # (test_infra.py), so that a new ceiling is no cluster update.
        "okTotalUnreadyCount": "100",
    }
    pools = {r.inputs["agentPoolName"] for r in off.of_type(AGENT_POOL)}
    assert pools == {"gpu244695ac", "sys6c853e1f"}
    # The one ConfigMap is the run's record (workloads/job.py), not the expander's priorities.
    assert [r.name for r in off.of_type(CONFIG_MAP)] == ["workloads-job-run-1"]
    assert "onDemandPoolName" not in off.outputs
    worker = _worker(off)
    assert worker["nodeSelector"] == {
        "spot-lab/pool": "gpu-spot",
        "spot-lab/pool-generation": "gpu244695ac",
    }
    assert "affinity" not in worker
    plugin = off.one(DAEMONSET, "device-plugin").inputs["spec"]["template"]["spec"]
    assert plugin["nodeSelector"] == {"spot-lab/pool": "gpu-spot"} and "affinity" not in plugin
    assert off.outputs["watchCommands"]["gpu_nodes"].startswith(
        "kubectl get nodes -l spot-lab/pool=gpu-spot "
    )


def test_every_resource_name_is_the_same_with_the_fallback_on_plus_its_own(
    on: ProgramRun, off: ProgramRun
) -> None:
    def names(run: ProgramRun) -> set[str]:
        return {f"{r.type}::{r.name}" for r in run.resources}

    assert names(on) - names(off) == {
        f"{AGENT_POOL}::cluster-gpu-on-demand",
        f"{COMMAND}::cluster-gpu-on-demand-bounds",
        f"{CONFIG_MAP}::workloads-autoscaler-priorities-configmap",
    }
    assert names(off) <= names(on)
