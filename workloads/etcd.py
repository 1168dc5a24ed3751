"""etcd on the system pool: the rendezvous the elastic job's agents meet in."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_kubernetes as k8s

from workloads.manifests.etcd import (
    EtcdSpec,
    etcd_client_host,
    etcd_client_service,
    etcd_disruption_budget,
    etcd_member_endpoints,
    etcd_network_policy,
    etcd_peer_service,
    etcd_statefulset,
)
from workloads.ordering import child_options


@dataclass
class RendezvousArgs:
    """Inputs of ``Rendezvous``."""

    spec: EtcdSpec
    """Namespace, size, priority class and admitted clients of the etcd cluster."""


class Rendezvous(pulumi.ComponentResource):
    """An etcd StatefulSet (three members, or one), its Services, PodDisruptionBudget (with three)
    and NetworkPolicy."""

    host: pulumi.Output[str]
    """The client Service's DNS name (the PyTorchJob's rdzvHost)."""
    port: pulumi.Output[int]

    def __init__(
        self, name: str, args: RendezvousArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        super().__init__("spot-lab:workloads:Rendezvous", name, None, opts)
        spec = args.spec
        spec.validate()
        child = child_options(self, opts)
        peers = etcd_peer_service(spec)
        peer_service = k8s.core.v1.Service(
            f"{name}-peers", metadata=peers["metadata"], spec=peers["spec"], opts=child
        )
        client = etcd_client_service(spec)
        client_service = k8s.core.v1.Service(
            f"{name}-client", metadata=client["metadata"], spec=client["spec"], opts=child
        )
        policy = etcd_network_policy(spec)
        k8s.networking.v1.NetworkPolicy(
            f"{name}-network-policy", metadata=policy["metadata"], spec=policy["spec"], opts=child
        )
        if (budget := etcd_disruption_budget(spec)) is not None:
            k8s.policy.v1.PodDisruptionBudget(
                f"{name}-disruption-budget",
                metadata=budget["metadata"],
                spec=budget["spec"],
                opts=child,
            )
        members = etcd_statefulset(spec)
        # Created after the peer Service: members look each other up through it at start.
        k8s.apps.v1.StatefulSet(
            f"{name}-statefulset",
            metadata=members["metadata"],
            spec=members["spec"],
            opts=child_options(self, opts, depends_on=[peer_service]),
        )
        self.host = client_service.metadata.apply(lambda _: etcd_client_host(spec))
        self.members = etcd_member_endpoints(spec)
        self.port = pulumi.Output.from_input(spec.client_port)
        self.register_outputs({"host": self.host, "port": self.port})
