"""The two PriorityClasses: preemptible training below the rendezvous control plane."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_kubernetes as k8s

from workloads.manifests.priority import PriorityClassSpec, priority_class_manifest
from workloads.ordering import child_options


@dataclass
class PriorityClassesArgs:
    """Inputs of ``PriorityClasses``."""

    training: PriorityClassSpec
    """The workers' class: low value, preemptionPolicy Never."""
    rendezvous: PriorityClassSpec
    """etcd's class: above the workers'."""


class PriorityClasses(pulumi.ComponentResource):
    """Cluster-wide PriorityClasses for the training workers and the rendezvous."""

    training: pulumi.Output[str]
    rendezvous: pulumi.Output[str]

    def __init__(
        self, name: str, args: PriorityClassesArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        super().__init__("spot-lab:workloads:PriorityClasses", name, None, opts)
        if args.training.value >= args.rendezvous.value:
            raise ValueError(
                f"the training priority ({args.training.value}) must be below the rendezvous "
                f"priority ({args.rendezvous.value}): etcd is scheduled first"
            )
        child = child_options(self, opts)
        self.training = self._register(f"{name}-training", args.training, child)
        self.rendezvous = self._register(f"{name}-rendezvous", args.rendezvous, child)
        self.register_outputs({"training": self.training, "rendezvous": self.rendezvous})

    def _register(
        self, name: str, spec: PriorityClassSpec, opts: pulumi.ResourceOptions
    ) -> pulumi.Output[str]:
        obj = priority_class_manifest(spec)
        created = k8s.scheduling.v1.PriorityClass(
            name,
            metadata=obj["metadata"],
            value=obj["value"],
            preemption_policy=obj["preemptionPolicy"],
            global_default=obj["globalDefault"],
            description=obj["description"],
            opts=opts,
        )
        return created.metadata.name
