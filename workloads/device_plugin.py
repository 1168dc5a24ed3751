"""The NVIDIA device plugin DaemonSet on the GPU Spot pool."""

from __future__ import annotations

from dataclasses import dataclass, field

import pulumi
import pulumi_kubernetes as k8s

from workloads.manifests.device_plugin import DevicePluginSpec, device_plugin_daemonset
from workloads.ordering import child_options


@dataclass
class NvidiaDevicePluginArgs:
    """Inputs of ``NvidiaDevicePlugin``."""

    spec: DevicePluginSpec = field(default_factory=DevicePluginSpec)
    """Namespace, image and node selector of the plugin."""


class NvidiaDevicePlugin(pulumi.ComponentResource):
    """Advertises ``nvidia.com/gpu`` on GPU nodes (AKS installs only the driver)."""

    name: pulumi.Output[str]

    def __init__(
        self, name: str, args: NvidiaDevicePluginArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        super().__init__("spot-lab:workloads:NvidiaDevicePlugin", name, None, opts)
        obj = device_plugin_daemonset(args.spec)
        daemonset = k8s.apps.v1.DaemonSet(
            f"{name}-daemonset",
            metadata=obj["metadata"],
            spec=obj["spec"],
            opts=child_options(self, opts),
        )
        self.name = daemonset.metadata.name
        self.register_outputs({"name": self.name})
