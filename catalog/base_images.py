"""The images our images are built on: where each Dockerfile's base lives, and what it must hold.

``lab preflight`` resolves each base against its registry, anonymously, before anything is
created (a missing tag would otherwise fail ``pulumi up`` inside ``az acr build``, 10 minutes
in). The Dockerfiles are the one home of the pins; this module reads them. Pure: no pulumi
import, no I/O beyond reading the Dockerfiles.

Why the training image is torch's CUDA 12.6 build on ``python:3.11-slim-bookworm``:

- torch 2.13 publishes two stable CUDA builds, 12.6 (cuDNN 9.10.2.21, NCCL 2.29.3) and 13.0
  (cuDNN 9.20.0.48), and 13.2 as experimental (pytorch/pytorch ``RELEASE.md``, Release
  Compatibility Matrix). The default PyPI wheel is the 13.0 one: ``pip install torch==2.13.0``
  resolves to a wheel that requires ``cuda-toolkit==13.0.3`` and ``nvidia-cudnn-cu13``. The 12.6
  build is on PyTorch's index ``download.pytorch.org/whl/cu126``, with the CUDA libraries it
  needs as ``nvidia-*-cu12`` wheels: the base needs no CUDA of its own.
- AKS installs the NVIDIA 570 driver branch on GPU node pools (Azure/AKS #5207: the 550 branch
  reached end of life, 570 is the default from node image 20250806). CUDA 12.x runs on any
  driver from 525 (minor version compatibility); CUDA 13.0 needs 580 or later. So the 12.6
  build is the one that runs on AKS's driver, on every size we accept (T4 sm_75, A10 sm_86,
  A100 sm_80, H100 sm_90 are all in its architecture list).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

DOCKER_HUB = "registry-1.docker.io"
"""Docker Hub's registry API host (``docker.io`` in image names)."""
TRAINING_DOCKERFILES = ("Dockerfile", "Dockerfile.stager")
"""The images built from ``training/``: the workers' and the data-staging Job's."""
TORCH_CUDA_BUILDS = {"2.13.0": ("12.6", "13.0")}
"""Stable CUDA builds per torch release (RELEASE.md), for the release the image pins."""
AKS_GPU_DRIVER_BRANCH = 570
"""The NVIDIA driver branch AKS installs on GPU pools (``gpuProfile.driver: Install``)."""
MIN_DRIVER_FOR_CUDA_MAJOR = {12: 525, 13: 580}
"""The oldest driver branch each CUDA major version runs on (NVIDIA CUDA compatibility)."""
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
BASE_REGISTRY_ARG = "BASE_REGISTRY"
"""The Dockerfiles' ``ARG`` that names the registry a base is pulled from: ``docker.io`` when
built by hand; ``pulumi up`` first imports each base into the lab's registry by its digest and
builds with ``--build-arg BASE_REGISTRY=<the lab's login server>`` (``infra/image.py``), so no
build pulls anonymously from Docker Hub, whose limit a shared build agent's address exhausts
(Azure-Samples/azure-search-openai-demo #3101, MicrosoftLearning/mslearn-azure-ai #125)."""
_ARG = re.compile(r"\$\{(?P<braced>\w+)\}|\$(?P<bare>\w+)")


@dataclass(frozen=True)
class ImageRef:
    """A base image reference, split the way a registry's API wants it."""

    registry: str
    """API host, e.g. ``registry-1.docker.io``."""
    repository: str
    """e.g. ``pytorch/pytorch``; Docker Hub's official images are ``library/<name>``."""
    tag: str
    digest: str = ""
    """``sha256:<hex>`` when pinned by digest, which then wins over the tag when pulling."""
    imported: bool = False
    """Its registry is ``BASE_REGISTRY_ARG``'s: ``pulumi up`` imports it into the lab's registry
    and the build pulls it from there."""

    @property
    def reference(self) -> str:
        """The reference as written after FROM."""
        name = (
            self.repository.removeprefix("library/")
            if self.registry == DOCKER_HUB
            else (f"{self.registry}/{self.repository}")
        )
        return f"{name}:{self.tag}" + (f"@{self.digest}" if self.digest else "")


def parse_image_ref(text: str) -> ImageRef:
    """``name[:tag][@digest]`` into registry, repository, tag and digest (Docker's rules: a first
    component with a '.' or ':' or ``localhost`` is a registry; else Docker Hub)."""
    name, _, digest = text.partition("@")
    if digest and not _DIGEST.match(digest):
        raise ValueError(f"image {text!r}: the digest must be sha256:<64 hex digits>")
    slash = name.rfind("/")
    colon = name.rfind(":")
    name, tag = (name[:colon], name[colon + 1 :]) if colon > slash else (name, "latest")
    first, _, rest = name.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        registry, repository = first, rest
    else:
        registry, repository = DOCKER_HUB, name if "/" in name else f"library/{name}"
    if registry == "docker.io":
        registry = DOCKER_HUB
    return ImageRef(registry, repository, tag, digest)


def dockerfile_bases(text: str) -> list[ImageRef]:
    """The base of each stage of a Dockerfile (``FROM [--platform=...] image [AS name]``),
    skipping stages built on an earlier stage; an ``ARG`` declared before the first ``FROM``
    is read with its default (Docker: such an ARG "can be used in FROM")."""
    stages: set[str] = set()
    bases: list[ImageRef] = []
    defaults: dict[str, str] = {}
    for line in text.splitlines():
        words = line.split()
        if words and words[0].upper() == "ARG" and not bases and len(words) > 1:
            name, _, default = words[1].partition("=")
            defaults[name] = default
        if not words or words[0].upper() != "FROM":
            continue
        args = [w for w in words[1:] if not w.startswith("--")]
        if len(args) >= 3 and args[1].upper() == "AS":
            stages.add(args[2].lower())
        if args and args[0].lower() not in stages:
            used = {m["braced"] or m["bare"] for m in _ARG.finditer(args[0])}
            image = _ARG.sub(lambda m: defaults.get(m["braced"] or m["bare"], ""), args[0])
            ref = parse_image_ref(image)
            bases.append(replace(ref, imported=BASE_REGISTRY_ARG in used))
    return bases


def training_base_images(training_dir: Path) -> dict[str, list[ImageRef]]:
    """``{Dockerfile name: its bases}`` for every image built from ``training/``."""
    return {
        name: dockerfile_bases((training_dir / name).read_text()) for name in TRAINING_DOCKERFILES
    }


def runs_on_aks_driver(cuda: str, driver_branch: int = AKS_GPU_DRIVER_BRANCH) -> bool:
    """Whether a CUDA ``X.Y`` build runs on the given NVIDIA driver branch."""
    major = int(cuda.split(".")[0])
    return driver_branch >= MIN_DRIVER_FOR_CUDA_MAJOR.get(major, 10**6)
