"""What the whole program registers in the cluster, checked as the API server would see it.

The builders have their own tests; these check the objects as registered through the
components (config, Azure outputs and Pulumi's serialisation included): every core object
against the Kubernetes OpenAPI schema, and the settings the lab's story depends on.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import pytest

from tests.support.pulumi_harness import ProgramRun, Registered, run_program
from tests.support.workload_specs import validate_strictly
from workloads.manifests.device_plugin import DEVICE_PLUGIN_DIR, DEVICE_PLUGIN_IMAGE
from workloads.manifests.etcd import ETCD_IMAGE, RENDEZVOUS_SERVER_FLAGS
from workloads.manifests.scheduling import GPU_SPOT_POOL, SYSTEM_POOL

# API groups built into Kubernetes: their schemas ship with kubernetes-validate.
CORE_GROUPS = {
    "core",
    "apps",
    "batch",
    "policy",
    "autoscaling",
    "networking.k8s.io",
    "scheduling.k8s.io",
    "storage.k8s.io",
    "rbac.authorization.k8s.io",
}
# Registered kubernetes: types that are not core objects, and where they are checked instead.
NOT_CORE = {
    "kubernetes:kustomize/v2:Directory",  # the operator overlay, built by the provider
    "kubernetes:kubeflow.org/v1:PyTorchJob",  # a CRD: checked against the v1.9.4 models
}
PYTORCHJOB = "kubernetes:kubeflow.org/v1:PyTorchJob"


@functools.cache
def _dev_run() -> ProgramRun:
    return run_program("dev")


def _is_core(resource: Registered) -> bool:
    parts = resource.type.split(":")
    return parts[0] == "kubernetes" and parts[1].split("/")[0] in CORE_GROUPS


def _core_objects() -> list[Registered]:
    # Sorted: Pulumi registers resources in whatever order its tasks finish, and parallel test
    # workers must each collect the same parameters in the same order.
    core = [r for r in _dev_run().resources if _is_core(r)]
    return sorted(core, key=lambda r: (r.type, r.name))


@pytest.fixture(scope="module")
def run() -> ProgramRun:
    return _dev_run()


@pytest.mark.parametrize(
    "resource", _core_objects(), ids=lambda r: f"{r.type.rsplit(':', 1)[1]}-{r.name}"
)
def test_every_registered_core_object_fits_the_kubernetes_schema(resource: Registered) -> None:
    manifest = resource.inputs
    assert manifest["apiVersion"].split("/")[-1] == resource.type.split(":")[1].split("/")[-1]
    assert manifest["kind"] == resource.type.rsplit(":", 1)[1]
    validate_strictly(manifest)


def test_nothing_kubernetes_escapes_a_schema_check(run: ProgramRun) -> None:
    kinds = {r.type for r in run.resources if r.type.startswith("kubernetes:")}
    core = {r.type for r in _core_objects()}
    assert kinds - core == NOT_CORE
    assert len(core) >= 9


def _one_by_kind(run: ProgramRun, kind: str) -> dict[str, Any]:
    (resource,) = [r for r in _core_objects() if r.type.endswith(f":{kind}")]
    return resource.inputs


def _containers(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in pod["containers"]}


def test_registered_etcd_serves_the_v2_api_from_the_pinned_image(run: ProgramRun) -> None:
    statefulset = _one_by_kind(run, "StatefulSet")
    pod = statefulset["spec"]["template"]["spec"]
    etcd = _containers(pod)["etcd"]
    assert set(RENDEZVOUS_SERVER_FLAGS) <= set(etcd["command"])
    assert not [arg for arg in etcd["command"] if "v2" in arg]
    assert etcd["image"] == ETCD_IMAGE
    assert re.fullmatch(r"quay\.io/coreos/etcd:v3\.6\.\d+", etcd["image"])
    assert etcd["readinessProbe"]["httpGet"] == {"path": "/health", "port": 2379}
    assert etcd["livenessProbe"]["httpGet"] == {"path": "/health?serializable=true", "port": 2379}
    assert statefulset["spec"]["replicas"] == 3
    assert pod["nodeSelector"] == SYSTEM_POOL


def test_registered_etcd_keeps_one_member_per_system_node(run: ProgramRun) -> None:
    """Required, not preferred: a preference lets the scheduler put two of three members on one
    node, and that node's loss takes the quorum; the pool has a node per member (3 by
    default, stack_config refuses fewer)."""
    statefulset = _one_by_kind(run, "StatefulSet")
    anti = statefulset["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    assert "preferredDuringSchedulingIgnoredDuringExecution" not in anti
    (term,) = anti["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"] == statefulset["spec"]["selector"]
    assert run.config["spot-lab:systemNodeCount"] == "3" == run.config["spot-lab:etcdMembers"]
    budget = _one_by_kind(run, "PodDisruptionBudget")["spec"]
    assert budget["minAvailable"] == 2
    assert budget["selector"] == statefulset["spec"]["selector"]


def test_a_one_member_etcd_has_no_budget_to_block_its_nodes_drain() -> None:
    """etcdMembers 1 on a one-node system pool (a throwaway dev stack): one member, and no
    disruption budget, which with its only member would block every drain of that node."""
    one = run_program("dev", {"etcdMembers": "1", "systemNodeCount": "1"})
    (statefulset,) = [r.inputs for r in one.resources if r.type.endswith(":StatefulSet")]
    assert statefulset["spec"]["replicas"] == 1
    assert "--initial-cluster=etcd-0=http://" in " ".join(
        statefulset["spec"]["template"]["spec"]["containers"][0]["command"]
    )
    assert [r for r in one.resources if r.type.endswith("PodDisruptionBudget")] == []


def test_registered_device_plugin_runs_on_every_gpu_spot_node(run: ProgramRun) -> None:
    (daemonset,) = [
        r.inputs
        for r in run.resources
        if r.type.endswith(":DaemonSet") and "device-plugin" in r.name
    ]
    pod = daemonset["spec"]["template"]["spec"]
    (plugin,) = pod["containers"]
    assert plugin["image"] == DEVICE_PLUGIN_IMAGE == "nvcr.io/nvidia/k8s-device-plugin:v0.19.3"
    assert daemonset["metadata"]["namespace"] == "kube-system"
    assert pod["nodeSelector"] == GPU_SPOT_POOL
    assert pod["priorityClassName"] == "system-node-critical"
    tolerated = {(t["key"], t["effect"]) for t in pod["tolerations"]}
    assert {
        ("kubernetes.azure.com/scalesetpriority", "NoSchedule"),
        ("nvidia.com/gpu", "NoSchedule"),
    } <= tolerated
    (volume,) = pod["volumes"]
    assert volume["hostPath"]["path"] == DEVICE_PLUGIN_DIR


def test_registered_job_workers_get_the_rendezvous_fix_a_gpu_and_shared_memory(
    run: ProgramRun,
) -> None:
    job = run.one(PYTORCHJOB).inputs
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert worker["restartPolicy"] == "ExitCode"
    pod = worker["template"]["spec"]
    container = _containers(pod)["pytorch"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"


def test_active_deadline_config_reaches_the_registered_job() -> None:
    job = run_program("dev", {"activeDeadlineSeconds": "43200"}).one(PYTORCHJOB).inputs
    assert job["spec"]["runPolicy"]["activeDeadlineSeconds"] == 43200


def test_a_multi_gpu_size_runs_a_process_per_gpu() -> None:
    # NC48ads_A100_v4 has 2 GPUs: one pod per node asks for both and runs two workers.
    run = run_program("dev", {"gpuVmSize": "Standard_NC48ads_A100_v4"})
    job = run.one(PYTORCHJOB).inputs["spec"]
    assert job["nprocPerNode"] == "2"
    pod = job["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    resources = _containers(pod)["pytorch"]["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == "2"
    assert resources["requests"] == {"cpu": "46600m", "memory": "419Gi"}
    env = {e["name"]: e["value"] for e in _containers(pod)["pytorch"]["env"]}
    assert "PET_NPROC_PER_NODE" not in env  # the operator sets it from nprocPerNode
    dev = run_program("dev").one(PYTORCHJOB).inputs["spec"]
    assert dev["nprocPerNode"] == "1"
