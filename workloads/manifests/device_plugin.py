"""The NVIDIA device plugin: makes each GPU node advertise ``nvidia.com/gpu``.

AKS installs only the NVIDIA driver on a GPU pool; without this DaemonSet no pod can ask
for a GPU and the training workers would stay Pending forever.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from workloads.manifests.scheduling import GPU_SPOT_POOL, gpu_spot_tolerations

# Pinned release (upstream's static manifest for it, unchanged in shape since v0.18.0): a moving
# tag could change how GPUs are advertised under a running job. v0.19.0 is the first with
# NVIDIA/k8s-device-plugin PR 1562 ("Fix healthchecking on old devices"): up to v0.18.2 a GPU
# whose NVML event registration returns NOT_SUPPORTED fell through to "Marking device ... as
# unhealthy" (internal/rm/health.go, two `if`s where v0.19.0 has a `switch`), and a device
# marked unhealthy never recovers, so the node's GPU was lost for good; the A10 sizes run GRID
# vGPU drivers (Azure/AKS #5875), where such registration can be unsupported. v0.19.3 is that
# line's latest patch; it also reverts v0.19.0's default-on mofed/gdrcopy/gds mounts (#1837).
DEVICE_PLUGIN_IMAGE = "nvcr.io/nvidia/k8s-device-plugin:v0.19.3"
DEVICE_PLUGIN_DIR = "/var/lib/kubelet/device-plugins"


@dataclass(frozen=True)
class DevicePluginSpec:
    """Where and which device plugin runs."""

    namespace: str = "kube-system"
    name: str = "nvidia-device-plugin-daemonset"
    image: str = DEVICE_PLUGIN_IMAGE
    node_selector: dict[str, str] = field(default_factory=lambda: dict(GPU_SPOT_POOL))
    """Only GPU nodes; elsewhere the plugin would find no device."""
    affinity: dict[str, Any] | None = None
    """With the on-demand fallback: nodes of either GPU pool (``any_gpu_pool``), in place of the
    Spot pool's selector."""


def device_plugin_daemonset(spec: DevicePluginSpec) -> dict[str, Any]:
    """The device plugin DaemonSet for the GPU pools."""
    labels = {"name": "nvidia-device-plugin-ds"}
    container = {
        "name": "nvidia-device-plugin-ctr",
        "image": spec.image,
        # Log and wait instead of crash-looping while the driver is still being installed.
        "env": [{"name": "FAIL_ON_INIT_ERROR", "value": "false"}],
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
        "volumeMounts": [{"name": "device-plugin", "mountPath": DEVICE_PLUGIN_DIR}],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": spec.name, "namespace": spec.namespace, "labels": labels},
        "spec": {
            "selector": {"matchLabels": labels},
            "updateStrategy": {"type": "RollingUpdate"},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    # A node without its plugin has no schedulable GPUs: never evict it first.
                    "priorityClassName": "system-node-critical",
                    **({"nodeSelector": dict(spec.node_selector)} if spec.node_selector else {}),
                    **({"affinity": spec.affinity} if spec.affinity else {}),
                    # The GPU pool is tainted for GPUs and, being Spot, for eviction.
                    "tolerations": gpu_spot_tolerations(),
                    "containers": [container],
                    "volumes": [
                        {
                            "name": "device-plugin",
                            "hostPath": {"path": DEVICE_PLUGIN_DIR, "type": "Directory"},
                        }
                    ],
                },
            },
        },
    }
