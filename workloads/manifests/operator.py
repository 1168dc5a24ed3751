"""The Kubeflow training operator v1: the controller behind the PyTorchJob API.

v1.9.4 is the last v1 release; its successor (Trainer v2, TrainJob) has no elastic
training, which is why the lab stays on PyTorchJob v1.
"""

from __future__ import annotations

import re

TRAINING_OPERATOR_VERSION = "v1.9.4"
# What the standalone overlay installs, and what the rendezvous NetworkPolicy admits.
OPERATOR_NAMESPACE = "kubeflow"
OPERATOR_POD_LABELS = {"control-plane": "kubeflow-training-operator"}
_RELEASE_TAG = re.compile(r"^v1\.\d+\.\d+$")


def training_operator_source(version: str = TRAINING_OPERATOR_VERSION) -> str:
    """The standalone kustomize overlay pinned to a v1 release tag.

    Kustomize's remote form (``<repo>.git/<path>?ref=<tag>``): the kustomize v2 Directory
    resolves it itself. A branch would move under a running cluster, so only tags pass.
    """
    if not _RELEASE_TAG.match(version):
        raise ValueError(
            f"training operator version must be a v1 release tag such as "
            f"{TRAINING_OPERATOR_VERSION}, got {version!r}"
        )
    return f"github.com/kubeflow/training-operator.git/manifests/overlays/standalone?ref={version}"
