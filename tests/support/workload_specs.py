"""What the workloads' tests share: a strict check of an object against the Kubernetes schema,
and a training job's spec with overrides."""

from __future__ import annotations

from typing import Any

import kubernetes_validate

from workloads.manifests.job import (
    ElasticJobSpec,
)

K8S_VERSION = "1.33"


def validate_strictly(obj: dict[str, Any]) -> None:
    """Raise ``kubernetes_validate.ValidationError`` unless ``obj`` fits the Kubernetes
    OpenAPI schema of ``K8S_VERSION``, unknown fields included (the API server would drop
    them silently)."""
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


IMAGE = "spotlabacr.azurecr.io/spot-lab-train:0123456789ab"
RDZV_HOST = "etcd.spot-lab.svc.cluster.local"


def _job_spec(**overrides: Any) -> ElasticJobSpec:
    values: dict[str, Any] = {
        "name": "spotlab-train",
        "namespace": "spot-lab",
        "image": IMAGE,
        "rdzv_host": RDZV_HOST,
        "min_replicas": 1,
        "max_replicas": 3,
        "replicas": 2,
        "max_restarts": 100,
        "service_account": "trainer",
        "priority_class": "spotlab-training",
        "data_claim": "spot-lab-dataset",
        "checkpoint_uri": "https://spotlabsa.blob.core.windows.net/checkpoints/spotlab-train",
        "max_steps": 20000,
        "global_batch_size": 256,
        "checkpoint_every_steps": 100,
        "checkpoint_every_seconds": 300,
        "collective_timeout_s": 30,
        "worker_cpu": "3",
        "worker_memory": "12Gi",
    }
    values.update(overrides)
    return ElasticJobSpec(**values)
