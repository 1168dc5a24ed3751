"""The GPU nodes' agent: its DaemonSet, its rights and its network policy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi_kubernetes as k8s

from workloads.manifests.node_agent import (
    NodeAgentSpec,
    node_agent_daemonset,
    node_agent_network_policy,
    node_agent_rbac,
)
from workloads.ordering import child_options

_SNAKE = {"roleRef": "role_ref"}
"""The SDK's keyword for a manifest's field where the two differ."""
_KINDS = {
    "ServiceAccount": k8s.core.v1.ServiceAccount,
    "Role": k8s.rbac.v1.Role,
    "RoleBinding": k8s.rbac.v1.RoleBinding,
    "ClusterRole": k8s.rbac.v1.ClusterRole,
    "ClusterRoleBinding": k8s.rbac.v1.ClusterRoleBinding,
}


@dataclass
class NodeAgentArgs:
    """Inputs of ``NodeAgent``."""

    spec: pulumi.Input[NodeAgentSpec]
    """Namespace, image (an Output of the build), priority and placement."""
    namespace: str
    """The namespace, known before the image is."""


class NodeAgent(pulumi.ComponentResource):
    """Evicts the workers of a GPU node on Azure's notice (``training/node_agent/``)."""

    name: pulumi.Output[str]

    def __init__(
        self, name: str, args: NodeAgentArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        super().__init__("spot-lab:workloads:NodeAgent", name, None, opts)
        rights: list[pulumi.Resource] = []
        for obj in node_agent_rbac(args.namespace):
            fields: dict[str, Any] = {
                _SNAKE.get(k, k): v for k, v in obj.items() if k not in ("apiVersion", "kind")
            }
            kind = obj["kind"]
            rights.append(
                _KINDS[kind](f"{name}-{kind.lower()}", **fields, opts=child_options(self, opts))
            )
        policy = node_agent_network_policy(args.namespace)
        k8s.networking.v1.NetworkPolicy(
            f"{name}-egress",
            metadata=policy["metadata"],
            spec=policy["spec"],
            opts=child_options(self, opts),
        )
        daemonset = pulumi.Output.from_input(args.spec).apply(node_agent_daemonset)
        agents = k8s.apps.v1.DaemonSet(
            f"{name}-daemonset",
            metadata=daemonset["metadata"],
            spec=daemonset["spec"],
            opts=child_options(self, opts, depends_on=rights),
        )
        self.name = agents.metadata.name
        self.register_outputs({"name": self.name})
