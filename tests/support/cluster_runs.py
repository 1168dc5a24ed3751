"""A cluster as the lab's Azure commands meet it through the fake Kubernetes API: the stack's
outputs that point at it, its records, and the volume mount failures its events report."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from kubernetes import config as k8s_config

from lab.azure.cluster.kube import Cluster, Target
from tests.support.kube_replay import (
    JOB,
    NS,
    FakeKube,
    kubeconfig,
)
from training.records import METRICS

DATASET = "spot-lab-dataset"


REFUSED_OLD = (
    f'MountVolume.SetUp failed for volume "{DATASET}" : rpc error: code = Internal desc = Mount '
    "failed with error: rpc error: code = Unknown desc = exit status 1 Error: failed to initialize "
    "new pipeline [failed to authenticate credentials for azstorage], output: Please refer to "
    "http://aka.ms/blobmounterror for possible causes and solutions for mount errors."
)


NO_BLOB_DRIVER = (
    f'MountVolume.SetUp failed for volume "{DATASET}" : kubernetes.io/csi: mounter.SetUpAt failed '
    "to get CSI client: driver name blob.csi.azure.com not found in the list of registered CSI "
    "drivers"
)


TIMED_OUT = (
    "Unable to attach or mount volumes: unmounted volumes=[dataset], unattached volumes=[dataset "
    "dshm local kube-api-access-7xk2p]: timed out waiting for the condition"
)


def _line(ts: float, **record: Any) -> str:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts)) + f".{int(ts % 1 * 1e9):09d}Z"
    return f"{stamp} {json.dumps({'ts': ts, 'rank': 0, **record})}"


def metrics_record(step: int, world: int) -> dict[str, Any]:
    """A training step's metrics line, as the training program logs it."""
    return {
        "kind": METRICS,
        "step": step,
        "world_size": world,
        "loss": 1.0,
        "samples_per_s": 400.0,
    }


def _write_outputs(tmp_path: Path, config: dict[str, Any]) -> Path:
    """A stack's outputs file with ``config`` as its kubeconfig."""
    path = tmp_path / "outputs.json"
    outputs = {
        "kubeconfig": json.dumps(config),
        "namespace": NS,
        "jobName": JOB,
        "nodeResourceGroup": "MC_spotlab-rg_spotlab-aks_westus3",
        "gpuPoolName": "gpu",
    }
    path.write_text(json.dumps(outputs))
    return path


def _outputs(tmp_path: Path, kube: FakeKube) -> Path:
    return _write_outputs(tmp_path, kubeconfig(kube.url))


def _cluster(kube: FakeKube) -> Cluster:
    api = k8s_config.new_client_from_config_dict(kubeconfig(kube.url))
    return Cluster(Target(kubeconfig(kube.url), NS, JOB), api)
