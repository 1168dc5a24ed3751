"""InfiniBand for the workers: NVIDIA's Network Operator, its OFED driver and RDMA device plugin
on the GPU nodes (``workloads/manifests/network_operator.py`` says from where and why)."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_kubernetes as k8s

from workloads.manifests.network_operator import (
    CHART,
    CHART_REPOSITORY,
    CHART_VERSION,
    NAMESPACE,
    chart_values,
    namespace_manifest,
    nic_cluster_policy,
)
from workloads.ordering import child_options


@dataclass
class NetworkOperatorArgs:
    """Inputs of ``NetworkOperator``."""

    vm_size: str
    """The GPU size with InfiniBand whose nodes get the driver and the plugin."""


class NetworkOperator(pulumi.ComponentResource):
    """The operator (Helm), then the NicClusterPolicy it reconciles; the workers' pods need its
    ``rdma/shared_ib`` before they can be scheduled."""

    def __init__(
        self, name: str, args: NetworkOperatorArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        super().__init__("spot-lab:workloads:NetworkOperator", name, None, opts)
        ns = namespace_manifest()
        namespace = k8s.core.v1.Namespace(
            f"{name}-namespace", metadata=ns["metadata"], opts=child_options(self, opts)
        )
        chart = k8s.helm.v4.Chart(
            f"{name}-chart",
            chart=CHART,
            version=CHART_VERSION,
            namespace=NAMESPACE,
            repository_opts=k8s.helm.v4.RepositoryOptsArgs(repo=CHART_REPOSITORY),
            values=chart_values(),
            opts=child_options(self, opts, depends_on=[namespace]),
        )
        policy = nic_cluster_policy(args.vm_size)
        k8s.apiextensions.CustomResource(
            f"{name}-nic-cluster-policy",
            api_version=policy["apiVersion"],
            kind=policy["kind"],
            metadata=policy["metadata"],
            spec=policy["spec"],
            # Its CRD comes with the chart.
            opts=child_options(self, opts, depends_on=[chart]),
        )
        self.register_outputs({})
