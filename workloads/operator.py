"""The Kubeflow training operator v1, installed from its pinned standalone kustomize overlay."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
from pulumi_kubernetes.kustomize.v2 import Directory

from workloads.manifests.operator import (
    OPERATOR_NAMESPACE,
    TRAINING_OPERATOR_VERSION,
    training_operator_source,
)
from workloads.ordering import child_options


@dataclass
class TrainingOperatorArgs:
    """Inputs of ``TrainingOperator``."""

    version: str = TRAINING_OPERATOR_VERSION
    """A v1 release tag of kubeflow/training-operator."""


class TrainingOperator(pulumi.ComponentResource):
    """CRDs, webhook and controller of the PyTorchJob API.

    The overlay is built by the provider (kustomize v2 Directory), and applied server-side:
    the PyTorchJob CRD is larger than the annotation client-side apply would store.
    Anything creating a PyTorchJob must depend on this component.
    """

    version: pulumi.Output[str]
    namespace: pulumi.Output[str]

    def __init__(
        self, name: str, args: TrainingOperatorArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        super().__init__("spot-lab:workloads:TrainingOperator", name, None, opts)
        Directory(
            f"{name}-kustomize",
            directory=training_operator_source(args.version),
            opts=child_options(self, opts),
        )
        self.version = pulumi.Output.from_input(args.version)
        self.namespace = pulumi.Output.from_input(OPERATOR_NAMESPACE)
        self.register_outputs({"version": self.version, "namespace": self.namespace})
