"""The cluster autoscaler's priorities: with the on-demand fallback on, the Spot pool first."""

from __future__ import annotations

import pulumi
import pulumi_kubernetes as k8s

from workloads.manifests.autoscaler import priority_expander_configmap
from workloads.ordering import child_options


class AutoscalerPriorities(pulumi.ComponentResource):
    """The ``cluster-autoscaler-priority-expander`` ConfigMap AKS's autoscaler reads when its
    profile says ``expander: priority`` (``infra/cluster.py``)."""

    name: pulumi.Output[str]

    def __init__(self, name: str, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("spot-lab:workloads:AutoscalerPriorities", name, None, opts)
        obj = priority_expander_configmap()
        config_map = k8s.core.v1.ConfigMap(
            f"{name}-configmap",
            metadata=obj["metadata"],
            data=obj["data"],
            opts=child_options(self, opts),
        )
        self.name = config_map.metadata.name
        self.register_outputs({"name": self.name})
