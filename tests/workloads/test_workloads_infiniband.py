"""InfiniBand where the size has it (``rdma``): what the program registers for an ND size, and
that nothing of it exists for a size without InfiniBand or with ``rdma: off``."""

from __future__ import annotations

import functools
import json
from typing import Any

import pytest

from catalog.gpu_sizes import gpu_size, nccl_ib_env
from tests.support.pulumi_harness import ProgramRun, Registered, run_program
from workloads.manifests.network_operator import CHART_VERSION
from workloads.manifests.pod_security import BASELINE_CAPABILITIES, _rules

ND = {"gpuVmSize": "Standard_ND96asr_v4", "workerCpu": "80", "workerMemory": "800Gi"}
VAP = "kubernetes:admissionregistration.k8s.io/v1:ValidatingAdmissionPolicy"
BINDING = "kubernetes:admissionregistration.k8s.io/v1:ValidatingAdmissionPolicyBinding"


@functools.cache
def _run(rdma: str = "auto", size: str = "nd") -> ProgramRun:
    config = dict(ND) if size == "nd" else {}
    return run_program("dev", {**config, "rdma": rdma})


def _worker(run: ProgramRun) -> dict[str, Any]:
    job = run.one("kubernetes:kubeflow.org/v1:PyTorchJob")
    (container,) = job.inputs["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"][
        "containers"
    ]
    return container


def _namespace(run: ProgramRun) -> Registered:
    return run.one("kubernetes:core/v1:Namespace", "workloads-namespace-namespace")


def test_an_nd_worker_asks_for_the_rdma_device_ipc_lock_and_the_sizes_nccl_settings() -> None:
    worker = _worker(_run())
    assert worker["resources"]["limits"]["rdma/shared_ib"] == "1"
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert worker["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}
    env = {e["name"]: e["value"] for e in worker["env"] if e["name"].startswith("NCCL_")}
    size = gpu_size("Standard_ND96asr_v4")
    assert size is not None and size.infiniband is not None
    assert (
        env
        == nccl_ib_env(size)
        == {
            "NCCL_IB_DISABLE": "0",
            "NCCL_IB_HCA": "mlx5",
            "NCCL_IB_PCI_RELAXED_ORDERING": "1",
            "NCCL_SOCKET_IFNAME": "eth0",
        }
    )


@pytest.mark.parametrize(("rdma", "size"), [("auto", "t4"), ("off", "nd")])
def test_without_infiniband_nothing_of_it_exists(rdma: str, size: str) -> None:
    run = _run(rdma, size)
    worker = _worker(run)
    assert "rdma/shared_ib" not in worker["resources"]["limits"]
    assert "securityContext" not in worker
    assert not [e for e in worker["env"] if e["name"].startswith("NCCL_IB")]
    types = {r.type for r in run.resources}
    assert not {VAP, BINDING, "kubernetes:helm.sh/v4:Chart"} & types
    labels = _namespace(run).inputs["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "baseline"


def test_the_network_operator_is_the_guides_and_reaches_the_gpu_nodes() -> None:
    run = _run()
    chart = run.one("kubernetes:helm.sh/v4:Chart")
    assert (chart.inputs["chart"], chart.inputs["version"]) == ("network-operator", CHART_VERSION)
    assert chart.inputs["repositoryOpts"]["repo"] == "https://helm.ngc.nvidia.com/nvidia"
    assert chart.inputs["namespace"] == "network-operator"
    worker = chart.inputs["values"]["node-feature-discovery"]["worker"]
    assert {t["key"] for t in worker["tolerations"]} == {
        "kubernetes.azure.com/scalesetpriority",
        "nvidia.com/gpu",
    }
    namespace = run.one("kubernetes:core/v1:Namespace", "network-operator")
    assert namespace.inputs["metadata"]["labels"] == {
        "pod-security.kubernetes.io/enforce": "privileged"
    }
    policy = run.one("kubernetes:mellanox.com/v1alpha1:NicClusterPolicy")
    spec = policy.inputs["spec"]
    (term,) = spec["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert term["matchExpressions"] == [
        {
            "key": "node.kubernetes.io/instance-type",
            "operator": "In",
            "values": ["Standard_ND96asr_v4"],
        }
    ]
    plugin = json.loads(spec["rdmaSharedDevicePlugin"]["config"])["configList"][0]
    assert plugin["resourceName"] == "shared_ib"
    assert plugin["selectors"] == {"vendors": ["15b3"], "linkTypes": ["infiniband"]}
    assert spec["ofedDriver"]["image"] == "doca-driver"
    assert run.waits_for(policy, chart)
    job = run.one("kubernetes:kubeflow.org/v1:PyTorchJob")
    assert run.waits_for(job, policy)


def test_the_namespace_allows_ipc_lock_and_still_refuses_what_baseline_refuses() -> None:
    run = _run()
    namespace = _namespace(run)
    assert namespace.inputs["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == (
        "privileged"
    )
    assert namespace.inputs["metadata"]["labels"]["pod-security.kubernetes.io/audit"] == (
        "baseline"
    )
    policy, binding = run.one(VAP), run.one(BINDING)
    # In force before the namespace relaxes its own enforcement.
    assert run.waits_for(namespace, binding) and run.waits_for(binding, policy)
    assert binding.inputs["spec"]["validationActions"] == ["Deny"]
    assert binding.inputs["spec"]["policyName"] == policy.inputs["metadata"]["name"]
    assert binding.inputs["spec"]["matchResources"]["namespaceSelector"] == {
        "matchLabels": {"kubernetes.io/metadata.name": "spot-lab"}
    }
    spec = policy.inputs["spec"]
    assert spec["failurePolicy"] == "Fail"
    (rule,) = spec["matchConstraints"]["resourceRules"]
    assert rule["resources"] == ["pods", "pods/ephemeralcontainers"]
    assert "initContainers" in spec["variables"][0]["expression"]
    messages = " | ".join(v["message"] for v in spec["validations"])
    # Each control of the Pod Security Standards' Baseline.
    for control in (
        "host namespaces",
        "privileged",
        "capabilities",
        "hostPath",
        "host ports",
        "HostProcess",
        "/proc mount",
        "seccomp",
        "AppArmor",
        "SELinux",
        "sysctls",
    ):
        assert control in messages, control
    capabilities = next(e for e, what in _rules() if what.startswith("capabilities"))
    assert "'IPC_LOCK'" in capabilities
    assert all(f"'{c}'" in capabilities for c in BASELINE_CAPABILITIES)
    assert "'SYS_ADMIN'" not in capabilities and "'NET_RAW'" not in capabilities
