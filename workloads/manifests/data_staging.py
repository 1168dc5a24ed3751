"""The data-staging Job: the task's data into the ``data`` container before the training job
exists (CIFAR-10's archive, or the character LM's corpus: training/data/sources.py).

It runs ``python -m training.data.stage_data`` from the staging image
(``training/Dockerfile.stager``: the training package with a CPU-only torch, no CUDA) on the
system pool (no GPU is started for it), as its own ServiceAccount, whose identity is the only
one that may write ``data``. Its name carries a hash of the source and checksum: a new source is
a new Job (a Job's pod template cannot be changed in place), an unchanged one is left alone. A
Job that failed (a mirror down for a while) is replaced by the next ``pulumi up`` rather than
met again as Failed: pulumi-kubernetes replaces an unready Job that carries
``pulumi.com/replaceUnready: "true"`` (provider.go, Diff: it reads the live Job and, when the
Job checker says it is not ready, plans a replacement).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from training.data.sources import FORMATS
from workloads.manifests.namespace import WORKLOAD_IDENTITY_USE
from workloads.manifests.scheduling import ROLE_LABEL, SYSTEM_POOL

STAGER_LABELS = {ROLE_LABEL: "stager"}
# Retries for what a retry may fix (the program exits 1 for network and storage errors; a
# wrong checksum or archive exits 2 and fails the same way each time, so few retries).
BACKOFF_LIMIT = 3
REPLACE_UNREADY = {"pulumi.com/replaceUnready": "true"}
"""Makes the next ``pulumi up`` replace this Job when it failed."""
# The official archive is 163 MB: minutes on any network; an hour means something is wrong.
DEADLINE_S = 3600


@dataclass(frozen=True)
class DataStagingSpec:
    """What the staging Job needs."""

    job_prefix: str
    """The training job's name; the staging Job is ``<prefix>-stage-<hash>``."""
    namespace: str
    image: str
    service_account: str
    source_url: str
    checksum: str
    container_uri: str
    """``https://<account>.blob.core.windows.net/data``."""
    data_format: str = "cifar10"
    """How ``stage_data`` checks and unpacks it (``training.data.sources.FORMATS``)."""

    def validate(self) -> None:
        """Raise ValueError naming the field when it cannot work."""
        if not self.container_uri.startswith("https://"):
            raise ValueError(f"container_uri must be an https:// URL, got {self.container_uri!r}")
        if not self.image or ":" not in self.image.rsplit("/", 1)[-1]:
            raise ValueError(f"image must carry an explicit tag, got {self.image!r}")
        if self.data_format not in FORMATS:
            raise ValueError(
                f"data_format must be one of {', '.join(FORMATS)}, got {self.data_format!r}"
            )


def staging_job_name(spec: DataStagingSpec) -> str:
    """``<prefix>-stage-<8 hex>`` of the source and checksum."""
    digest = hashlib.sha256(f"{spec.source_url}\0{spec.checksum}".encode()).hexdigest()
    return f"{spec.job_prefix}-stage-{digest[:8]}"


def staging_command(spec: DataStagingSpec) -> list[str]:
    """The container's command line."""
    return [
        "python",
        "-m",
        "training.data.stage_data",
        "--source",
        spec.source_url,
        "--checksum",
        spec.checksum,
        "--container-uri",
        spec.container_uri,
        "--format",
        spec.data_format,
    ]


def staging_job_manifest(spec: DataStagingSpec) -> dict[str, Any]:
    """The batch/v1 Job that stages the data."""
    spec.validate()
    labels = {"app.kubernetes.io/part-of": "spot-lab", **STAGER_LABELS}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": staging_job_name(spec),
            "namespace": spec.namespace,
            "labels": labels,
            "annotations": dict(REPLACE_UNREADY),
        },
        "spec": {
            "backoffLimit": BACKOFF_LIMIT,
            "activeDeadlineSeconds": DEADLINE_S,
            "template": {
                # The workload identity webhook injects the token only into labelled pods.
                "metadata": {"labels": {**labels, **WORKLOAD_IDENTITY_USE}},
                "spec": {
                    "serviceAccountName": spec.service_account,
                    "restartPolicy": "Never",
                    "nodeSelector": dict(SYSTEM_POOL),
                    "containers": [
                        {
                            "name": "stage-data",
                            "image": spec.image,
                            "command": staging_command(spec),
                            "resources": {
                                "requests": {"cpu": "250m", "memory": "512Mi"},
                                "limits": {"memory": "1Gi"},
                            },
                            # The archive is unpacked in the pod's scratch space.
                            "env": [{"name": "TMPDIR", "value": "/scratch"}],
                            "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}],
                        }
                    ],
                    "volumes": [{"name": "scratch", "emptyDir": {"sizeLimit": "2Gi"}}],
                },
            },
        },
    }
