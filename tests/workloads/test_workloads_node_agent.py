"""The GPU nodes' agent as the program registers it: on every GPU node, from the training image,
inside the namespace's Pod Security baseline, with only the rights and the network paths it
needs; and no other pod of the namespace can reach the instance metadata address."""

from __future__ import annotations

import functools
from typing import Any

import pytest

from tests.support.pulumi_harness import ProgramRun, Registered, run_program
from workloads.manifests.namespace import IMDS_CIDR, WORKLOAD_IDENTITY_USE
from workloads.manifests.scheduling import TRAINER_LABELS

NETWORK_POLICY = "kubernetes:networking.k8s.io/v1:NetworkPolicy"
DAEMONSET = "kubernetes:apps/v1:DaemonSet"
# Pod Security "baseline": the capabilities a container may add (Kubernetes, "Pod Security
# Standards", Baseline, Capabilities); everything else, hostNetwork and hostPath included, it
# refuses.
BASELINE_CAPABILITIES = {
    "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
    "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
}  # fmt: skip


@functools.cache
def _run(fallback: bool = False) -> ProgramRun:
    return run_program("dev", {"onDemandMaxNodes": "2"} if fallback else None)


def _agent(run: ProgramRun) -> Registered:
    return run.one(DAEMONSET, "node-agent")


def _pod(resource: Registered) -> dict[str, Any]:
    spec = resource.inputs["spec"]
    return (spec.get("template") or spec["pytorchReplicaSpecs"]["Worker"]["template"])["spec"]


def test_it_runs_the_training_images_agent_with_the_workers_selector() -> None:
    run = _run()
    agent, job = _agent(run), run.one("kubernetes:kubeflow.org/v1:PyTorchJob")
    (container,) = _pod(agent)["containers"]
    (worker,) = _pod(job)["containers"]
    assert container["image"] == worker["image"] == run.outputs["image"]
    assert container["command"] == [
        "python", "-m", "training.node_agent", "--worker-selector=spot-lab/role=trainer",
    ]  # fmt: skip
    worker_labels = job.inputs["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["metadata"]
    assert TRAINER_LABELS.items() <= worker_labels["labels"].items()
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"]}
    assert env == {"NODE_NAME": "spec.nodeName", "POD_NAMESPACE": "metadata.namespace"}
    assert agent.inputs["metadata"]["namespace"] == "spot-lab"


@pytest.mark.parametrize("fallback", [False, True])
def test_it_runs_where_the_device_plugin_runs(fallback: bool) -> None:
    run = _run(fallback)
    agent, plugin = _pod(_agent(run)), _pod(run.one(DAEMONSET, "device-plugin"))
    assert agent.get("nodeSelector") == plugin.get("nodeSelector")
    assert agent.get("affinity") == plugin.get("affinity")
    keys = {t["key"] for t in agent["tolerations"]}
    assert {t["key"] for t in plugin["tolerations"]} <= keys
    assert "remediator.kubernetes.azure.com/unschedulable" in keys  # AKS's auto-drain taint
    assert agent["priorityClassName"] == "spotlab-rendezvous"  # above the workers'


def test_it_stays_inside_pod_security_baseline() -> None:
    pod = _pod(_agent(_run()))
    assert not {"hostNetwork", "hostPID", "hostIPC"} & pod.keys()
    assert all("hostPath" not in v for v in pod.get("volumes", []))
    (container,) = pod["containers"]
    context = container["securityContext"]
    assert context.get("privileged") is not True
    assert set(context.get("capabilities", {}).get("add", [])) <= BASELINE_CAPABILITIES
    assert context["capabilities"]["drop"] == ["ALL"]
    assert context["runAsNonRoot"] is True and context["allowPrivilegeEscalation"] is False
    # No workload identity: it needs no Azure token, only its ServiceAccount's.
    labels = _agent(_run()).inputs["spec"]["template"]["metadata"]["labels"]
    assert not WORKLOAD_IDENTITY_USE.items() <= labels.items()
    assert pod["serviceAccountName"] == "node-agent"


def test_its_rights_are_the_workers_pods_and_the_nodes() -> None:
    run = _run()
    role = run.one("kubernetes:rbac.authorization.k8s.io/v1:Role", "node-agent")
    assert role.inputs["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "delete"]}
    ]
    cluster_role = run.one("kubernetes:rbac.authorization.k8s.io/v1:ClusterRole", "node-agent")
    assert cluster_role.inputs["rules"] == [
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "patch"]}
    ]
    for kind in ("RoleBinding", "ClusterRoleBinding"):
        binding = run.one(f"kubernetes:rbac.authorization.k8s.io/v1:{kind}", "node-agent")
        assert binding.inputs["subjects"] == [
            {"kind": "ServiceAccount", "name": "node-agent", "namespace": "spot-lab"}
        ]
    assert run.waits_for(_agent(run), binding)


def _selects(policy: dict[str, Any], labels: dict[str, str]) -> bool:
    """A NetworkPolicy's podSelector against a pod's labels (matchLabels, In and NotIn)."""
    selector = policy["spec"]["podSelector"]
    if not (selector.get("matchLabels") or {}).items() <= labels.items():
        return False
    for term in selector.get("matchExpressions") or []:
        present = labels.get(term["key"]) in term["values"]
        if (term["operator"] == "In") != present:
            return False
    return True


def _reaches_metadata(rule: dict[str, Any]) -> bool:
    if "to" not in rule:
        return False  # ports only (HTTPS): checked below for the agent
    return any(
        "ipBlock" in peer and IMDS_CIDR not in peer["ipBlock"].get("except", [])
        for peer in rule["to"]
    )


def test_only_the_agent_may_reach_the_metadata_address() -> None:
    run = _run()
    policies = [p.inputs for p in run.of_type(NETWORK_POLICY)]
    pods = [
        r for r in run.resources
        if r.type in (DAEMONSET, "kubernetes:apps/v1:StatefulSet", "kubernetes:batch/v1:Job",
                      "kubernetes:kubeflow.org/v1:PyTorchJob")
        and (r.inputs.get("metadata") or {}).get("namespace") == "spot-lab"
    ]  # fmt: skip
    assert len(pods) == 4  # the agent, etcd, the staging Job, the workers
    for resource in pods:
        spec = resource.inputs["spec"]
        template = spec.get("template") or spec["pytorchReplicaSpecs"]["Worker"]["template"]
        labels = template["metadata"]["labels"]
        egress = [
            p for p in policies if _selects(p, labels) and "Egress" in p["spec"]["policyTypes"]
        ]
        assert egress, resource.name  # no pod of the namespace has unrestricted egress
        reach = any(_reaches_metadata(rule) for p in egress for rule in p["spec"]["egress"])
        assert reach == (resource.name == "workloads-node-agent-daemonset"), resource.name
    (agent_policy,) = [p for p in policies if p["metadata"]["name"] == "node-agent-egress"]
    assert agent_policy["spec"]["egress"] == [
        {"to": [{"ipBlock": {"cidr": IMDS_CIDR}}], "ports": [{"protocol": "TCP", "port": 80}]},
        {"ports": [{"protocol": "TCP", "port": 443}]},
    ]
    assert agent_policy["spec"]["ingress"] == []
