"""Builders of the lab's core Kubernetes objects: specific paths and the Kubernetes schemas."""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.support.workload_specs import validate_strictly
from workloads.manifests.device_plugin import DevicePluginSpec, device_plugin_daemonset
from workloads.manifests.etcd import (
    DATA_VOLUME,
    EtcdSpec,
    etcd_client_host,
    etcd_client_service,
    etcd_command,
    etcd_disruption_budget,
    etcd_network_policy,
    etcd_peer_service,
    etcd_statefulset,
)
from workloads.manifests.namespace import (
    identity_egress_policy,
    namespace_manifest,
    training_service_account,
)
from workloads.manifests.operator import OPERATOR_POD_LABELS, training_operator_source
from workloads.manifests.priority import (
    PriorityClassSpec,
    lab_priority_classes,
    priority_class_manifest,
    priority_class_manifests,
)
from workloads.manifests.scheduling import (
    GPU_SPOT_POOL,
    SPOT_TOLERATION,
    SYSTEM_POOL,
    TRAINER_LABELS,
)


def _etcd_spec(**overrides: Any) -> EtcdSpec:
    values: dict[str, Any] = {
        "namespace": "spot-lab",
        "priority_class": "spotlab-rendezvous",
        "operator_namespace": "kubeflow",
        "operator_pod_labels": dict(OPERATOR_POD_LABELS),
    }
    values.update(overrides)
    return EtcdSpec(**values)


def _all_objects() -> list[dict[str, Any]]:
    etcd = _etcd_spec()
    training, rendezvous = lab_priority_classes("spotlab")
    return [
        namespace_manifest("spot-lab"),
        training_service_account("trainer", "spot-lab", "client-id"),
        identity_egress_policy("spot-lab"),
        priority_class_manifest(training),
        priority_class_manifest(rendezvous),
        etcd_statefulset(etcd),
        etcd_client_service(etcd),
        etcd_peer_service(etcd),
        etcd_disruption_budget(etcd),
        etcd_network_policy(etcd),
        device_plugin_daemonset(DevicePluginSpec()),
    ]


@pytest.mark.parametrize(
    "obj", _all_objects(), ids=lambda o: f"{o['kind']}-{o['metadata']['name']}"
)
def test_every_object_validates_strictly_against_kubernetes(obj: dict[str, Any]) -> None:
    validate_strictly(obj)


# ---- etcd ------------------------------------------------------------------------------------


def _etcd_container(spec: EtcdSpec) -> dict[str, Any]:
    (container,) = etcd_statefulset(spec)["spec"]["template"]["spec"]["containers"]
    return container


def test_etcd_image_is_a_pinned_3_6_release_with_no_v2_flag() -> None:
    container = _etcd_container(_etcd_spec())
    assert re.fullmatch(r"quay\.io/coreos/etcd:v3\.6\.\d+", container["image"])
    assert not [arg for arg in container["command"] if "v2" in arg]  # 3.6 refuses them


def test_the_members_disks_are_new_ones_so_pulumi_replaces_a_3_5_statefulset() -> None:
    # etcd 3.6 will not start on a data dir whose v2 store holds keys; a changed
    # volumeClaimTemplates is a replace-on-change field of pulumi-kubernetes' StatefulSet,
    # so `pulumi up` over the 3.5 cluster replaces it, on new disks.
    statefulset = etcd_statefulset(_etcd_spec())
    (claim,) = statefulset["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == DATA_VOLUME != "data"  # the 3.5 cluster's claim
    (mount,) = statefulset["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    assert mount["name"] == DATA_VOLUME
    assert statefulset["spec"]["persistentVolumeClaimRetentionPolicy"]["whenDeleted"] == "Delete"


def test_etcd_members_know_each_other_by_stable_dns_names() -> None:
    command = etcd_command(_etcd_spec())
    peers = "etcd-peers.spot-lab.svc.cluster.local:2380"
    initial = next(a for a in command if a.startswith("--initial-cluster="))
    assert initial == (
        f"--initial-cluster=etcd-0=http://etcd-0.{peers},"
        f"etcd-1=http://etcd-1.{peers},etcd-2=http://etcd-2.{peers}"
    )
    assert (
        "--initial-advertise-peer-urls=http://$(POD_NAME).etcd-peers"
        + (".spot-lab.svc.cluster.local:2380")
        in command
    )
    sts = etcd_statefulset(_etcd_spec())["spec"]
    assert sts["serviceName"] == "etcd-peers"
    assert sts["podManagementPolicy"] == "Parallel"
    assert sts["replicas"] == 3


def test_etcd_runs_on_the_system_pool_only() -> None:
    pod = etcd_statefulset(_etcd_spec())["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == SYSTEM_POOL
    assert SPOT_TOLERATION not in pod["tolerations"]
    assert all(t["key"] != "nvidia.com/gpu" for t in pod["tolerations"])
    assert pod["priorityClassName"] == "spotlab-rendezvous"


def test_etcd_probes_resources_and_storage() -> None:
    container = _etcd_container(_etcd_spec())
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": 2379}
    assert container["livenessProbe"]["httpGet"]["path"].startswith("/health")
    assert container["livenessProbe"]["httpGet"]["port"] == 2379
    assert container["resources"]["requests"] == {"cpu": "100m", "memory": "256Mi"}
    (claim,) = etcd_statefulset(_etcd_spec())["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "1Gi"
    assert {"name": claim["metadata"]["name"], "mountPath": "/var/lib/etcd"} in container[
        "volumeMounts"
    ]


def test_etcd_client_service_is_the_rdzv_host() -> None:
    spec = _etcd_spec()
    service = etcd_client_service(spec)
    assert service["spec"]["type"] == "ClusterIP"
    assert [p["port"] for p in service["spec"]["ports"]] == [2379]
    assert service["spec"]["selector"] == spec.labels
    assert etcd_client_host(spec) == "etcd.spot-lab.svc.cluster.local"
    assert service["metadata"]["name"] == etcd_client_host(spec).split(".")[0]


def test_etcd_peer_service_is_headless_and_publishes_unready_members() -> None:
    service = etcd_peer_service(_etcd_spec())
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert {p["port"] for p in service["spec"]["ports"]} == {2379, 2380}


def test_etcd_disruption_budget_keeps_quorum() -> None:
    assert etcd_disruption_budget(_etcd_spec())["spec"]["minAvailable"] == 2
    assert etcd_disruption_budget(_etcd_spec(replicas=5))["spec"]["minAvailable"] == 3


def test_etcd_network_policy_admits_trainers_and_the_operator_only() -> None:
    spec = _etcd_spec()
    policy = etcd_network_policy(spec)["spec"]
    assert policy["podSelector"] == {"matchLabels": spec.labels}
    assert policy["policyTypes"] == ["Ingress"]
    clients, members = policy["ingress"]
    assert clients["ports"] == [{"protocol": "TCP", "port": 2379}]
    assert clients["from"] == [
        {"podSelector": {"matchLabels": TRAINER_LABELS}},
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kubeflow"}},
            "podSelector": {"matchLabels": OPERATOR_POD_LABELS},
        },
    ]
    # The peer port is open to the other members, and to nobody else.
    assert members["from"] == [{"podSelector": {"matchLabels": spec.labels}}]
    assert {"protocol": "TCP", "port": 2380} in members["ports"]


def test_etcd_without_an_operator_namespace_admits_trainers_only() -> None:
    policy = etcd_network_policy(_etcd_spec(operator_namespace=None))["spec"]
    assert policy["ingress"][0]["from"] == [{"podSelector": {"matchLabels": TRAINER_LABELS}}]


@pytest.mark.parametrize("replicas", [0, 2, 4])
def test_etcd_needs_an_odd_quorum_of_at_least_three_or_one_member(replicas: int) -> None:
    with pytest.raises(ValueError, match="etcd replicas must be odd and >= 3"):
        etcd_statefulset(_etcd_spec(replicas=replicas))


def test_a_single_member_has_no_disruption_budget() -> None:
    assert etcd_statefulset(_etcd_spec(replicas=1))["spec"]["replicas"] == 1
    assert etcd_disruption_budget(_etcd_spec(replicas=1)) is None


# ---- priority classes ------------------------------------------------------------------------


def test_training_is_preemptible_and_below_the_rendezvous() -> None:
    training, rendezvous = (priority_class_manifest(s) for s in lab_priority_classes("lab"))
    assert training["metadata"]["name"] == "lab-training"
    assert training["preemptionPolicy"] == "Never"
    assert training["value"] < rendezvous["value"]
    assert rendezvous["preemptionPolicy"] == "PreemptLowerPriority"
    assert training["globalDefault"] is False and rendezvous["globalDefault"] is False


def test_priority_class_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="preemption_policy must be one of Never"):
        priority_class_manifest(PriorityClassSpec("x", 1, "Sometimes", "d"))
    with pytest.raises(ValueError, match="value must be in"):
        priority_class_manifest(PriorityClassSpec("x", 2_000_000_000, "Never", "d"))


def test_the_training_class_must_be_below_the_rendezvous_class() -> None:
    training, rendezvous = lab_priority_classes("spotlab")
    assert [m["metadata"]["name"] for m in priority_class_manifests(training, rendezvous)] == [
        "spotlab-training",
        "spotlab-rendezvous",
    ]
    with pytest.raises(ValueError, match=r"training priority \(1000000\) must be below"):
        priority_class_manifests(rendezvous, training)


# ---- device plugin ---------------------------------------------------------------------------


def test_device_plugin_on_gpu_spot_nodes() -> None:
    daemonset = device_plugin_daemonset(DevicePluginSpec())
    pod = daemonset["spec"]["template"]["spec"]
    assert pod["containers"][0]["image"] == "nvcr.io/nvidia/k8s-device-plugin:v0.19.3"
    assert pod["priorityClassName"] == "system-node-critical"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    assert SPOT_TOLERATION in pod["tolerations"]
    assert pod["nodeSelector"] == GPU_SPOT_POOL
    assert daemonset["metadata"]["namespace"] == "kube-system"


# ---- namespace, identity, operator -----------------------------------------------------------


def test_service_account_is_bound_to_the_training_identity() -> None:
    account = training_service_account("trainer", "spot-lab", "client-123")
    assert account["metadata"]["annotations"] == {"azure.workload.identity/client-id": "client-123"}
    with pytest.raises(ValueError, match="client_id must not be empty"):
        training_service_account("trainer", "spot-lab", "")


def test_namespace_enforces_baseline_pod_security() -> None:
    labels = namespace_manifest("spot-lab")["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "baseline"


def test_operator_overlay_is_pinned_to_the_release_tag() -> None:
    assert training_operator_source() == (
        "github.com/kubeflow/training-operator.git/manifests/overlays/standalone?ref=v1.9.4"
    )
    with pytest.raises(ValueError, match="must be a v1 release tag"):
        training_operator_source("master")


def test_identity_pods_reach_their_peers_and_dns_but_not_the_metadata_service() -> None:
    spec = identity_egress_policy("spot-lab")["spec"]
    rules = spec["egress"]
    world = [p["ipBlock"] for r in rules for p in r["to"] if "ipBlock" in p]
    assert world == [{"cidr": "0.0.0.0/0", "except": ["169.254.169.254/32"]}]
    # Cilium never matches an ipBlock against a pod: etcd and the peers need their own rule.
    assert {"to": [{"podSelector": {}}]} in rules
    (dns,) = [r for r in rules if "ports" in r]
    assert {(p["protocol"], p["port"]) for p in dns["ports"]} == {("UDP", 53), ("TCP", 53)}
    assert dns["to"][0]["podSelector"] == {"matchLabels": {"k8s-app": "kube-dns"}}
    assert spec["podSelector"] == {"matchLabels": {"azure.workload.identity/use": "true"}}
