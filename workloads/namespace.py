"""The lab's namespace, the training ServiceAccount bound to the training identity, and the
egress policy that keeps pods with an identity away from the node's."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_kubernetes as k8s

from workloads.manifests.namespace import (
    identity_egress_policy,
    metadata_egress_policy,
    namespace_manifest,
    training_service_account,
)
from workloads.manifests.pod_security import baseline_with_ipc_lock
from workloads.ordering import child_options


@dataclass
class LabNamespaceArgs:
    """Inputs of ``LabNamespace``."""

    name: str
    """Namespace of etcd, the volume claims and the training job."""
    service_account: str
    """ServiceAccount the training pods run as (the federated credential names it)."""
    training_client_id: pulumi.Input[str]
    """Client id of the training identity (workload identity)."""
    allow_ipc_lock: bool = False
    """InfiniBand: Pod Security baseline plus IPC_LOCK, by a policy of ours."""


class LabNamespace(pulumi.ComponentResource):
    """The namespace, the training pods' ServiceAccount, and their egress policy."""

    name: pulumi.Output[str]
    service_account: pulumi.Output[str]

    def __init__(
        self, name: str, args: LabNamespaceArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        super().__init__("spot-lab:workloads:LabNamespace", name, None, opts)
        ns = namespace_manifest(args.name, args.allow_ipc_lock)
        # The policy that stands in for baseline is in force before the namespace relaxes it.
        before = self._baseline_with_ipc_lock(name, args, opts) if args.allow_ipc_lock else []
        namespace = k8s.core.v1.Namespace(
            f"{name}-namespace",
            metadata=ns["metadata"],
            opts=child_options(self, opts, depends_on=before),
        )
        account = pulumi.Output.from_input(args.training_client_id).apply(
            lambda client_id: training_service_account(args.service_account, args.name, client_id)
        )
        service_account = k8s.core.v1.ServiceAccount(
            f"{name}-service-account",
            metadata=account["metadata"],
            opts=child_options(self, opts, depends_on=[namespace]),
        )
        policy = identity_egress_policy(args.name)
        k8s.networking.v1.NetworkPolicy(
            f"{name}-identity-egress",
            metadata=policy["metadata"],
            spec=policy["spec"],
            opts=child_options(self, opts, depends_on=[namespace]),
        )
        # Only the GPU nodes' agent may reach the instance metadata service.
        no_metadata = metadata_egress_policy(args.name)
        k8s.networking.v1.NetworkPolicy(
            f"{name}-no-metadata-egress",
            metadata=no_metadata["metadata"],
            spec=no_metadata["spec"],
            opts=child_options(self, opts, depends_on=[namespace]),
        )
        self.name = namespace.metadata.name
        self.service_account = service_account.metadata.name
        self.register_outputs({"name": self.name, "service_account": self.service_account})

    def _baseline_with_ipc_lock(
        self, name: str, args: LabNamespaceArgs, opts: pulumi.ResourceOptions | None
    ) -> list[pulumi.Resource]:
        policy, binding = baseline_with_ipc_lock(args.name)
        created = k8s.admissionregistration.v1.ValidatingAdmissionPolicy(
            f"{name}-baseline-with-ipc-lock",
            metadata=policy["metadata"],
            spec=policy["spec"],
            opts=child_options(self, opts),
        )
        bound = k8s.admissionregistration.v1.ValidatingAdmissionPolicyBinding(
            f"{name}-baseline-with-ipc-lock-binding",
            metadata=binding["metadata"],
            spec=binding["spec"],
            opts=child_options(self, opts, depends_on=[created]),
        )
        return [created, bound]
