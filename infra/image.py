"""Images built from ``training/`` and pushed on ``pulumi up``, tagged by content.

Two images come from the same context: the training image (``training/Dockerfile``, torch with
CUDA, for the workers) and the staging image (``training/Dockerfile.stager``, Python with a
CPU-only torch, for the data-staging Job on a small CPU node). The tag is a hash of what the
build receives from ``training/`` (its files minus what ``training/.dockerignore`` excludes,
plus the Dockerfile being built), so changing anything an image sees builds a new image and
rolls its users onto it, while caches and other ignored files change nothing. By default the
build runs in the registry (ACR Tasks via ``az acr build``), so no local Docker daemon is
needed.
"""

from __future__ import annotations

import hashlib
import shlex
from dataclasses import dataclass
from pathlib import Path

import pulumi
import pulumi_command as command

from infra.build_context import DOCKERFILE, context_files

TAG_LENGTH = 16


def tree_digest(root: Path, dockerfile: str = DOCKERFILE) -> str:
    """sha256 over each context file's relative path and bytes, in sorted order."""
    if not root.is_dir():
        raise FileNotFoundError(f"image build context {root} is not a directory")
    digest = hashlib.sha256()
    for path in context_files(root, dockerfile):
        data = path.read_bytes()
        # Path and length framing: moving bytes between files changes the digest too.
        digest.update(f"{path.relative_to(root).as_posix()}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()


def image_tag(root: Path, dockerfile: str = DOCKERFILE) -> str:
    """The image tag for a build context and Dockerfile: a prefix of its tree digest."""
    return tree_digest(root, dockerfile)[:TAG_LENGTH]


# AKS's GPU nodes are x86-64: a build on an ARM laptop must not default to arm64, which fails
# on the node with "exec format error".
PLATFORM = "linux/amd64"


def build_command(
    builder: str,
    *,
    registry_name: str,
    login_server: str,
    resource_group: str,
    subscription_id: str,
    repository: str,
    tag: str,
    context: str,
    dockerfile: str = DOCKERFILE,
) -> str:
    """The shell command that builds ``context`` (a directory) with ``dockerfile`` (relative to
    it) and pushes ``repository:tag``.

    ``az`` is told the registry's resource group and subscription: without them it finds the
    registry by a subscription-wide lookup that lags right after the registry is created
    (Azure/azure-cli #27913), and in ``az``'s default subscription, not the stack's.
    """
    # Both take --file as a path from the working directory, not from the context: azure-cli's
    # acr build.py, "If docker_file_path is not specified, the default is Dockerfile in
    # source_location. Otherwise, it's based on current working directory."
    path = f"{context.rstrip('/')}/{dockerfile}"
    file = "" if dockerfile == DOCKERFILE else f" --file {shlex.quote(path)}"
    context = shlex.quote(context)
    where = f"--resource-group {shlex.quote(resource_group)}"
    where += f" --subscription {shlex.quote(subscription_id)}"
    if builder == "acr":
        image = shlex.quote(f"{repository}:{tag}")
        return (
            f"az acr build --registry {shlex.quote(registry_name)} {where}"
            f" --platform {PLATFORM} --image {image}{file} {context}"
        )
    if builder == "docker":
        ref = shlex.quote(f"{login_server}/{repository}:{tag}")
        return (
            f"az acr login --name {shlex.quote(registry_name)} --subscription "
            f"{shlex.quote(subscription_id)}"
            f" && docker build --platform {PLATFORM} --tag {ref}{file} {context}"
            f" && docker push {ref}"
        )
    raise ValueError(f"image builder must be one of acr, docker; got {builder!r}")


@dataclass
class TrainingImageArgs:
    """Inputs of ``TrainingImage``."""

    registry_name: pulumi.Input[str]
    """Registry to build in (acr) or push to (docker)."""
    login_server: pulumi.Input[str]
    """The registry's login server, e.g. ``name.azurecr.io``."""
    resource_group: pulumi.Input[str]
    """The registry's resource group."""
    subscription_id: pulumi.Input[str]
    """The stack's subscription, which may not be ``az``'s default."""
    project_dir: Path
    """The project root: where the Dockerfile is looked for and the tag is computed. The build
    command itself gets only the relative context (see ``TrainingImage``)."""
    context: str
    """The build context relative to the project root: ``training`` with its Dockerfile."""
    repository: str
    """Repository inside the registry."""
    builder: str = "acr"
    """``acr`` (ACR Tasks, no local daemon) or ``docker`` (local build and push)."""
    dockerfile: str = DOCKERFILE
    """The Dockerfile inside the context: ``Dockerfile`` or ``Dockerfile.stager``."""


class TrainingImage(pulumi.ComponentResource):
    """Builds and pushes an image from ``training/`` whenever what it sees of the tree changes."""

    tag: str
    image_ref: pulumi.Output[str]

    def __init__(
        self, name: str, args: TrainingImageArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        super().__init__("spot-lab:image:TrainingImage", name, None, opts)
        context_dir = args.project_dir / args.context
        if not (context_dir / args.dockerfile).is_file():
            raise FileNotFoundError(
                f"no {args.dockerfile} in the image build context {context_dir}"
            )
        tag = image_tag(context_dir, args.dockerfile)
        create = pulumi.Output.all(
            args.registry_name, args.login_server, args.resource_group, args.subscription_id
        ).apply(
            lambda reg: build_command(
                args.builder,
                registry_name=reg[0],
                login_server=reg[1],
                resource_group=reg[2],
                subscription_id=reg[3],
                repository=args.repository,
                tag=tag,
                context=args.context,
                dockerfile=args.dockerfile,
            )
        )
        build = command.local.Command(
            f"{name}-build",
            create=create,
            # No `dir`: an absolute path of this machine would be an input, so the same stack
            # run from a checkout elsewhere would rebuild. Unset, pulumi-command runs in its
            # working directory (local command runner: `cmd.Dir, err = os.Getwd()`), which the
            # engine sets to the project directory, where the relative context resolves.
            # A new tag (changed tree) replaces the command, which runs the build again.
            triggers=[tag],
            opts=pulumi.ResourceOptions(parent=self),
        )
        self.tag = tag
        # Derived from the build's stdout, so nothing can use the ref before the push is done.
        self.image_ref = pulumi.Output.all(build.stdout, args.login_server).apply(
            lambda out: f"{out[1]}/{args.repository}:{tag}"
        )
        self.register_outputs({"tag": self.tag, "image_ref": self.image_ref})
