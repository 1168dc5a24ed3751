"""PriorityClasses: the rendezvous outranks training, and training never preempts anyone.

This follows the Kubernetes guidance for elastic training: workers are preemptible (low
value, ``preemptionPolicy: Never``), while the job's control plane gets a higher class so
the scheduler makes room for it first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PREEMPTION_POLICIES = ("Never", "PreemptLowerPriority")
# User-defined classes must stay at or below this; larger values are reserved for system-*.
MAX_USER_PRIORITY = 1_000_000_000


@dataclass(frozen=True)
class PriorityClassSpec:
    """One PriorityClass."""

    name: str
    value: int
    """Higher runs first; at most 1e9 for user classes."""
    preemption_policy: str
    """"Never" (waits for room) or "PreemptLowerPriority" (evicts lower pods)."""
    description: str

    def validate(self) -> None:
        """Raise ValueError naming the field when a value is out of range."""
        if not 0 <= self.value <= MAX_USER_PRIORITY:
            raise ValueError(
                f"priority class {self.name}: value must be in [0, {MAX_USER_PRIORITY}], "
                f"got {self.value}"
            )
        if self.preemption_policy not in PREEMPTION_POLICIES:
            raise ValueError(
                f"priority class {self.name}: preemption_policy must be one of "
                f"{', '.join(PREEMPTION_POLICIES)}, got {self.preemption_policy!r}"
            )


def lab_priority_classes(prefix: str) -> tuple[PriorityClassSpec, PriorityClassSpec]:
    """(training, rendezvous) classes for the lab, named after ``prefix``."""
    training = PriorityClassSpec(
        name=f"{prefix}-training",
        value=1_000,
        preemption_policy="Never",
        description="Elastic training workers: preemptible, never preempt other pods.",
    )
    rendezvous = PriorityClassSpec(
        name=f"{prefix}-rendezvous",
        value=1_000_000,
        preemption_policy="PreemptLowerPriority",
        description="etcd rendezvous: the training job's control plane, scheduled first.",
    )
    return training, rendezvous


def priority_class_manifest(spec: PriorityClassSpec) -> dict[str, Any]:
    """The PriorityClass object for ``spec``."""
    spec.validate()
    return {
        "apiVersion": "scheduling.k8s.io/v1",
        "kind": "PriorityClass",
        "metadata": {"name": spec.name},
        "value": spec.value,
        "preemptionPolicy": spec.preemption_policy,
        "globalDefault": False,
        "description": spec.description,
    }


def priority_class_manifests(
    training: PriorityClassSpec, rendezvous: PriorityClassSpec
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The (training, rendezvous) PriorityClass objects; etcd must be scheduled first."""
    if training.value >= rendezvous.value:
        raise ValueError(
            f"the training priority ({training.value}) must be below the rendezvous "
            f"priority ({rendezvous.value}): etcd is scheduled first"
        )
    return priority_class_manifest(training), priority_class_manifest(rendezvous)
