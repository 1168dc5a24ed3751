"""etcd, the rendezvous: a small etcd cluster on the system pool that spot evictions never touch.

The rendezvous (training/elastic/rendezvous.py, on etcd's v3 API) keeps the membership of
every round in etcd, so the job survives losing any worker (unlike torch's ``c10d`` backend,
whose rendezvous lives inside worker 0's agent).
Three members, one per system node (required), keep quorum while any one system node is lost or
drained for an upgrade; a throwaway dev stack may run one member (``etcdMembers: 1``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from training.elastic.launch import RDZV_PORT
from workloads.manifests.scheduling import (
    CRITICAL_ADDONS_TOLERATION,
    RENDEZVOUS_LABELS,
    SYSTEM_POOL,
    TRAINER_LABELS,
)

# The current minor's latest patch (3.6.16): etcd supports its two newest minors, and 3.6
# serves the v3 API (and its JSON gateway) the rendezvous uses, with no v2 store at all.
ETCD_IMAGE = "quay.io/coreos/etcd:v3.6.16"
# The server flags the rendezvous depends on, in one place for the cluster's members and the
# local lab's etcd (``from workloads.manifests.etcd import RENDEZVOUS_SERVER_FLAGS``): none.
# The v3 API and its gateway are on by default in every etcd from 3.4 on.
RENDEZVOUS_SERVER_FLAGS: tuple[str, ...] = ()
DATA_VOLUME = "data-v3"
"""The members' disks. Named anew for the move from 3.5 (v2 API) to 3.6: etcd 3.6 refuses to
start on a data dir whose v2 store holds keys (the rendezvous' old ones), and a changed
``volumeClaimTemplates`` makes ``pulumi up`` replace the StatefulSet (pulumi-kubernetes lists
it among a StatefulSet's replace-on-change fields), so the members start on new, empty disks;
the old claims go with the old StatefulSet (``whenDeleted: Delete``). Its data was only the
rendezvous' ephemeral state."""
PEER_PORT = 2380
DATA_DIR = "/var/lib/etcd"
SINGLE_MEMBER = 1
"""One member: no quorum to keep, and none to lose. The rendezvous is down whenever that member's
node is, drained or lost, until the member is back on another node with its disk, and it has no
disruption budget (one that kept its only member would block every drain of its node)."""


@dataclass(frozen=True)
class EtcdSpec:
    """Everything that shapes the rendezvous etcd cluster."""

    namespace: str
    priority_class: str
    """The rendezvous PriorityClass (above the training workers')."""
    name: str = "etcd"
    """StatefulSet and client Service name; the Service's DNS name is the rdzvHost."""
    image: str = ETCD_IMAGE
    replicas: int = 3
    """Odd and >= 3, so quorum survives one member being drained or lost; or 1 for a throwaway
    dev stack (``SINGLE_MEMBER``)."""
    storage_class: str = "managed-csi"
    """AKS's built-in Azure Disk class; a restarted member must find its data to rejoin."""
    storage_size: str = "1Gi"
    cpu_request: str = "100m"
    memory_request: str = "256Mi"
    memory_limit: str = "512Mi"
    client_port: int = RDZV_PORT
    node_selector: dict[str, str] = field(default_factory=lambda: dict(SYSTEM_POOL))
    client_pod_labels: dict[str, str] = field(default_factory=lambda: dict(TRAINER_LABELS))
    """Pods in the namespace allowed to reach the client port: the training workers."""
    operator_namespace: str | None = None
    """Namespace of the training operator, also admitted to the client port (None: not)."""
    operator_pod_labels: dict[str, str] = field(default_factory=dict)

    def validate(self) -> None:
        """Raise ValueError naming the field when the cluster shape cannot keep quorum."""
        if self.replicas != SINGLE_MEMBER and (self.replicas < 3 or self.replicas % 2 == 0):
            raise ValueError(
                f"etcd replicas must be odd and >= 3 (quorum must survive a drained node), or 1 "
                f"(a throwaway dev stack), got {self.replicas}"
            )
        if self.client_port == PEER_PORT:
            raise ValueError(f"etcd client_port must differ from the peer port {PEER_PORT}")

    @property
    def peer_service(self) -> str:
        """The headless Service that gives each member a stable DNS name."""
        return f"{self.name}-peers"

    @property
    def labels(self) -> dict[str, str]:
        """Labels on every etcd pod and object."""
        return {"app.kubernetes.io/name": "etcd", **RENDEZVOUS_LABELS}

    @property
    def quorum(self) -> int:
        """Members that must be up for etcd to accept writes."""
        return self.replicas // 2 + 1


def etcd_client_host(spec: EtcdSpec) -> str:
    """The client Service's DNS name: the PyTorchJob's ``rdzvHost``."""
    return f"{spec.name}.{spec.namespace}.svc.cluster.local"


def _member_host(spec: EtcdSpec, member: str) -> str:
    return f"{member}.{spec.peer_service}.{spec.namespace}.svc.cluster.local"


def _members(spec: EtcdSpec) -> list[str]:
    """The members' pod names, as the StatefulSet names its replicas."""
    return [f"{spec.name}-{i}" for i in range(spec.replicas)]


def etcd_member_endpoints(spec: EtcdSpec) -> tuple[str, ...]:
    """Each member's own ``host:port``: an agent moves on to them from the client Service,
    whose connection kube-proxy pins to one member, when that one cannot serve it
    (training/elastic/etcd_v3.py, ``Members``)."""
    return tuple(f"{_member_host(spec, m)}:{spec.client_port}" for m in _members(spec))


def etcd_command(spec: EtcdSpec) -> list[str]:
    """The etcd command line; ``$(POD_NAME)`` is expanded by the kubelet from the env."""
    initial_cluster = ",".join(
        f"{m}=http://{_member_host(spec, m)}:{PEER_PORT}" for m in _members(spec)
    )
    own_host = _member_host(spec, "$(POD_NAME)")
    return [
        "/usr/local/bin/etcd",
        "--name=$(POD_NAME)",
        f"--data-dir={DATA_DIR}/data",
        f"--listen-client-urls=http://0.0.0.0:{spec.client_port}",
        f"--advertise-client-urls=http://{own_host}:{spec.client_port}",
        f"--listen-peer-urls=http://0.0.0.0:{PEER_PORT}",
        f"--initial-advertise-peer-urls=http://{own_host}:{PEER_PORT}",
        f"--initial-cluster={initial_cluster}",
        "--initial-cluster-state=new",
        f"--initial-cluster-token={spec.name}-{spec.namespace}",
        *RENDEZVOUS_SERVER_FLAGS,
        # Rendezvous keys churn on every round; compact hourly so the database stays small.
        "--auto-compaction-retention=1",
    ]


def _etcd_container(spec: EtcdSpec) -> dict[str, Any]:
    port = spec.client_port
    return {
        "name": "etcd",
        "image": spec.image,
        "command": etcd_command(spec),
        "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
        "ports": [
            {"name": "client", "containerPort": port},
            {"name": "peer", "containerPort": PEER_PORT},
        ],
        # Ready only with a leader: the client Service then sends requests only to members
        # that can answer them.
        "readinessProbe": {
            "httpGet": {"path": "/health", "port": port},
            "periodSeconds": 5,
            "failureThreshold": 3,
        },
        # Alive = this member answers, leader or not (etcd >= 3.5.3): restarting members
        # that lost quorum would only make the outage longer.
        "livenessProbe": {
            "httpGet": {"path": "/health?serializable=true", "port": port},
            "initialDelaySeconds": 15,
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 6,
        },
        "resources": {
            "requests": {"cpu": spec.cpu_request, "memory": spec.memory_request},
            "limits": {"memory": spec.memory_limit},
        },
        "volumeMounts": [{"name": DATA_VOLUME, "mountPath": DATA_DIR}],
        "securityContext": {"allowPrivilegeEscalation": False},
    }


def _spread_members(spec: EtcdSpec) -> dict[str, Any]:
    # One member per node, required: with a preference only, the scheduler may put two of three
    # on one node, and losing that node loses quorum. A member with no node free stays Pending
    # (the others keep quorum) instead; the system pool has at least as many nodes as members
    # (stack_config), and a node upgrade adds at least one surge node before it drains one (AKS,
    # "Upgrade an AKS cluster": max surge, at least one node).
    return {
        "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {
                    "labelSelector": {"matchLabels": spec.labels},
                    "topologyKey": "kubernetes.io/hostname",
                }
            ]
        }
    }


def etcd_statefulset(spec: EtcdSpec) -> dict[str, Any]:
    """The etcd StatefulSet: one member per pod, each with its own data disk."""
    spec.validate()
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": spec.name, "namespace": spec.namespace, "labels": spec.labels},
        "spec": {
            "serviceName": spec.peer_service,
            "replicas": spec.replicas,
            # All members must start together: none is ready until a quorum is up, so the
            # default one-by-one start would wait forever on member 0.
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": spec.labels},
            "template": {
                "metadata": {"labels": spec.labels},
                "spec": {
                    "priorityClassName": spec.priority_class,
                    "nodeSelector": dict(spec.node_selector),
                    "tolerations": [dict(CRITICAL_ADDONS_TOLERATION)],
                    "affinity": _spread_members(spec),
                    "containers": [_etcd_container(spec)],
                },
            },
            # Deleting the rendezvous deletes its disks; scaling down keeps them for a rejoin.
            "persistentVolumeClaimRetentionPolicy": {
                "whenDeleted": "Delete",
                "whenScaled": "Retain",
            },
            # A PVC per member: a restarted member must keep its data to rejoin the cluster
            # (with an emptyDir it would come back as a stranger with the same name).
            "volumeClaimTemplates": [
                {
                    "metadata": {"name": DATA_VOLUME},
                    "spec": {
                        "accessModes": ["ReadWriteOnce"],
                        "storageClassName": spec.storage_class,
                        "resources": {"requests": {"storage": spec.storage_size}},
                    },
                }
            ],
        },
    }


def etcd_client_service(spec: EtcdSpec) -> dict[str, Any]:
    """The ClusterIP Service the training agents connect to (the rdzvHost)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": spec.name, "namespace": spec.namespace, "labels": spec.labels},
        "spec": {
            "type": "ClusterIP",
            "selector": spec.labels,
            "ports": [{"name": "client", "port": spec.client_port, "targetPort": "client"}],
        },
    }


def etcd_peer_service(spec: EtcdSpec) -> dict[str, Any]:
    """The headless Service behind each member's stable DNS name."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": spec.peer_service,
            "namespace": spec.namespace,
            "labels": spec.labels,
        },
        "spec": {
            "clusterIP": "None",
            # Members must resolve each other before any of them is ready (no quorum yet).
            "publishNotReadyAddresses": True,
            "selector": spec.labels,
            "ports": [
                {"name": "client", "port": spec.client_port, "targetPort": "client"},
                {"name": "peer", "port": PEER_PORT, "targetPort": "peer"},
            ],
        },
    }


def etcd_disruption_budget(spec: EtcdSpec) -> dict[str, Any] | None:
    """Drains and upgrades may take members down only while a quorum stays up (None with a
    single member, which has no quorum to keep)."""
    spec.validate()
    if spec.replicas == SINGLE_MEMBER:
        return None
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": spec.name, "namespace": spec.namespace, "labels": spec.labels},
        "spec": {"minAvailable": spec.quorum, "selector": {"matchLabels": spec.labels}},
    }


def _client_peers(spec: EtcdSpec) -> list[dict[str, Any]]:
    peers: list[dict[str, Any]] = [{"podSelector": {"matchLabels": dict(spec.client_pod_labels)}}]
    if spec.operator_namespace:
        peers.append(
            {
                "namespaceSelector": {
                    "matchLabels": {"kubernetes.io/metadata.name": spec.operator_namespace}
                },
                "podSelector": {"matchLabels": dict(spec.operator_pod_labels)},
            }
        )
    return peers


def etcd_network_policy(spec: EtcdSpec) -> dict[str, Any]:
    """Only the training pods and the operator reach the client port; only members the peers.

    etcd serves plain HTTP inside the cluster, so this policy is its access control. The
    kubelet's probes come from the node itself, which the policy engine always admits.
    """
    members = [{"podSelector": {"matchLabels": spec.labels}}]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": spec.name, "namespace": spec.namespace, "labels": spec.labels},
        "spec": {
            "podSelector": {"matchLabels": spec.labels},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": _client_peers(spec),
                    "ports": [{"protocol": "TCP", "port": spec.client_port}],
                },
                {
                    "from": members,
                    "ports": [
                        {"protocol": "TCP", "port": spec.client_port},
                        {"protocol": "TCP", "port": PEER_PORT},
                    ],
                },
            ],
        },
    }
