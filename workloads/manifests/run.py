"""A run of the job: where it keeps its checkpoints, and the record of what it started with.

A run is one ``runId`` of the job. Its checkpoints are in the job's folder of the checkpoints
container, in a folder of their own per run identity (``TrainingRun.lineage``): a run whose
task, state options, seed, global batch or precision differ never meets another's checkpoints.
Its record (a ConfigMap) holds that identity as the run started, for ``pulumi up`` to compare
(``workloads/job.py``). Pure: no pulumi import.
"""

from __future__ import annotations

import json
from typing import Any

from stack_config import LabConfig
from workloads.manifests.job import RUN_ID_LABEL, job_name


def blob_url(blob_endpoint: str | None, container: str | None, path: str = "") -> str:
    """``<endpoint>/<container>[/<path>]``: where the workers write checkpoints (Blob API).

    Checkpoints always go through the Blob API, never the Blob CSI mount: the checkpoint
    protocol needs create-if-absent and consistent listings, which blobfuse2's per-node caches
    cannot give (``training/checkpoints/storage.py``). The dataset comes through the read-only
    volume.
    """
    if not blob_endpoint or not blob_endpoint.startswith("https://") or not container:
        raise ValueError(
            "the workers need an https:// blob_endpoint and a container, "
            f"got {blob_endpoint!r} and {container!r}"
        )
    return "/".join(p for p in (blob_endpoint.rstrip("/"), container, path.strip("/")) if p)


def checkpoint_path(config: LabConfig) -> str:
    """Where in the checkpoints container the run keeps its checkpoints: the job's folder, and
    in it one folder per run identity (``TrainingRun.lineage``) but for the built-in tasks at
    their default shape, which keep the job's folder itself."""
    lineage = config.training.lineage
    return f"{job_name(config)}/{lineage}" if lineage else job_name(config)


def run_record_name(config: LabConfig) -> str:
    """The run record's name: one per ``runId``."""
    return f"{job_name(config)}-run-{config.job.run_id}"


def run_record_manifest(config: LabConfig) -> dict[str, Any]:
    """The ConfigMap that records what run ``runId`` started with: its identity and lineage.

    ``pulumi up`` compares the stack's settings with it (``stack_config.train_args``
    ``identity_problem``); the component keeps the first values (``ignoreChanges``).
    """
    training = config.training
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": run_record_name(config),
            "namespace": config.namespace,
            "labels": {"app.kubernetes.io/part-of": "spot-lab", RUN_ID_LABEL: config.job.run_id},
        },
        "data": {
            "runId": config.job.run_id,
            "identity": json.dumps(dict(training.identity), sort_keys=True, default=str),
            "lineage": training.lineage,
        },
    }
