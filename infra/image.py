"""Images built from ``training/`` and pushed on ``pulumi up``, tagged by content.

Two images come from the same context: the training image (``training/Dockerfile``, torch with
CUDA, for the workers) and the staging image (``training/Dockerfile.stager``, Python with a
CPU-only torch, for the data-staging Job on a small CPU node). The tag is a hash of what the
build receives from ``training/`` (its files minus what ``training/.dockerignore`` excludes,
plus the Dockerfile being built), so changing anything an image sees builds a new image and
rolls its users onto it, while caches and other ignored files change nothing. By default the
build runs in the registry (ACR Tasks via ``az acr build``), so no local Docker daemon is
needed.

A third, the task image (``TaskImage``), is the training image plus the user's task package
(``taskPackage``) on its import path and the package's ``requirements.txt``
(``infra/task_image.Dockerfile``). Its context is the package, as its own ``.dockerignore``
leaves it; its tag hashes the training image's tag, that Dockerfile and those files, so a change
to the user's code, or to the lab's, is a new image and a new job, and nothing else is.
"""

from __future__ import annotations

import hashlib
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pulumi
import pulumi_command as command

from catalog.base_images import BASE_REGISTRY_ARG, ImageRef, training_base_images
from catalog.build_context import DOCKERFILE, context_files

TAG_LENGTH = 16
TASK_DOCKERFILE = "infra/task_image.Dockerfile"
"""The task image's Dockerfile, from the project directory (outside the package's context)."""
PACKAGE_ENV = "TASK_PACKAGE_DIR"
"""The build command's variable holding the package's path on the deployer's machine."""


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


def task_image_tag(base_tag: str, package: Path, dockerfile: Path) -> str:
    """The task image's tag: its base (the training image's tag), its Dockerfile, and every
    file of the package its build receives (none of the package's own Dockerfiles count)."""
    digest = hashlib.sha256()
    for part in (base_tag.encode(), dockerfile.read_bytes(), tree_digest(package, "").encode()):
        digest.update(f"{len(part)}\0".encode())
        digest.update(part)
    return digest.hexdigest()[:TAG_LENGTH]


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
    outside: bool = False,
    build_args: dict[str, str] | None = None,
) -> str:
    """The shell command that builds ``context`` (a directory) with ``dockerfile`` (relative to
    it) and pushes ``repository:tag``; ``build_args`` are its ``--build-arg``s (the training
    images' ``BASE_REGISTRY_ARG``: the lab's registry, after ``import_command``).

    ``outside``: ``dockerfile`` is a path from the working directory, outside the context (both
    builders take one), and ``context`` names an environment variable that holds the context's
    path, expanded by the shell (the path is the deployer's, kept out of the command).
    ``az`` is told the registry's resource group and subscription: without them it finds the
    registry by a subscription-wide lookup that lags right after the registry is created
    (Azure/azure-cli #27913), and in ``az``'s default subscription, not the stack's.
    """
    # Both take --file as a path from the working directory, not from the context: azure-cli's
    # acr build.py, "If docker_file_path is not specified, the default is Dockerfile in
    # source_location. Otherwise, it's based on current working directory."
    path = dockerfile if outside else f"{context.rstrip('/')}/{dockerfile}"
    file = "" if dockerfile == DOCKERFILE and not outside else f" --file {shlex.quote(path)}"
    context = f'"${{{context}}}"' if outside else shlex.quote(context)
    args = "".join(
        f" --build-arg {shlex.quote(f'{k}={v}')}" for k, v in sorted((build_args or {}).items())
    )
    where = f"--resource-group {shlex.quote(resource_group)}"
    where += f" --subscription {shlex.quote(subscription_id)}"
    if builder == "acr":
        image = shlex.quote(f"{repository}:{tag}")
        return (
            f"az acr build --registry {shlex.quote(registry_name)} {where}"
            f" --platform {PLATFORM} --image {image}{file}{args} {context}"
        )
    if builder == "docker":
        ref = shlex.quote(f"{login_server}/{repository}:{tag}")
        return (
            f"az acr login --name {shlex.quote(registry_name)} --subscription "
            f"{shlex.quote(subscription_id)}"
            f" && docker build --platform {PLATFORM} --tag {ref}{file}{args} {context}"
            f" && docker push {ref}"
        )
    raise ValueError(f"image builder must be one of acr, docker; got {builder!r}")


def import_command(
    *, registry_name: str, resource_group: str, subscription_id: str, base: ImageRef
) -> str:
    """``az acr import`` of one base, by its pinned digest, into the lab's registry under the
    same repository and tag, so the Dockerfile's ``FROM ${BASE_REGISTRY}/...@digest`` finds it
    there. ACR copies every platform of a multi-architecture image's manifest list (ACR, "Import
    container images": "images for all architectures and platforms specified in the manifest
    list get copied"; "identify an image by its manifest digest instead of by tag"). The copy is
    Azure's, once per registry and digest: Docker Hub's limit can refuse it too, but then the
    next `pulumi up` retries it, and no build ever pulls from Docker Hub. ``--force``: a tag left
    by an earlier, interrupted import is overwritten."""
    if not base.digest:
        raise ValueError(f"base image {base.reference} must be pinned by digest to be imported")
    source = f"docker.io/{base.repository}@{base.digest}"
    return (
        f"az acr import --name {shlex.quote(registry_name)}"
        f" --resource-group {shlex.quote(resource_group)}"
        f" --subscription {shlex.quote(subscription_id)}"
        f" --source {shlex.quote(source)} --image {shlex.quote(f'{base.repository}:{base.tag}')}"
        " --force"
    )


def imported_bases(training_dir: Path) -> list[ImageRef]:
    """The bases the Dockerfiles of ``training_dir`` pull through ``BASE_REGISTRY_ARG``, each
    once."""
    bases = [b for refs in training_base_images(training_dir).values() for b in refs if b.imported]
    return list(dict.fromkeys(bases))


@dataclass
class BaseImagesArgs:
    """Inputs of ``BaseImages``."""

    registry_name: pulumi.Input[str]
    resource_group: pulumi.Input[str]
    subscription_id: pulumi.Input[str]
    training_dir: Path
    """Where the Dockerfiles are: their ``FROM`` lines name the bases."""


class BaseImages(pulumi.ComponentResource):
    """The Dockerfiles' bases, imported into the lab's registry before any build."""

    imports: list[pulumi.Resource]

    def __init__(
        self, name: str, args: BaseImagesArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        super().__init__("spot-lab:image:BaseImages", name, None, opts)
        self.imports = []
        where = pulumi.Output.all(args.registry_name, args.resource_group, args.subscription_id)
        for base in imported_bases(args.training_dir):
            create = where.apply(
                lambda w, base=base: import_command(
                    registry_name=w[0], resource_group=w[1], subscription_id=w[2], base=base
                )
            )
            self.imports.append(
                command.local.Command(
                    f"{name}-{base.repository.replace('/', '-')}",
                    create=create,
                    # A new pin is a new import; an unchanged one is never imported again.
                    triggers=[base.digest],
                    opts=pulumi.ResourceOptions(parent=self),
                )
            )
        self.register_outputs({})


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
    base_images: BaseImages | None = None
    """The bases imported into this registry: the build pulls them from there, after them."""


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
        self.tag = tag
        imported = args.base_images is not None
        self.image_ref = pushed_image(
            self,
            name,
            args,
            tag,
            context=args.context,
            dockerfile=args.dockerfile,
            # The base from the lab's registry, once imported there: no Docker Hub pull.
            build_args={BASE_REGISTRY_ARG: args.login_server} if imported else None,
            depends_on=args.base_images.imports if args.base_images is not None else [],
        )
        self.register_outputs({"tag": self.tag, "image_ref": self.image_ref})


@dataclass
class TaskImageArgs:
    """Inputs of ``TaskImage``."""

    base: TrainingImage
    """The training image the task image adds the package to (built first)."""
    registry_name: pulumi.Input[str]
    login_server: pulumi.Input[str]
    resource_group: pulumi.Input[str]
    subscription_id: pulumi.Input[str]
    project_dir: Path
    """The project root: ``TASK_DOCKERFILE`` is read from there."""
    package_dir: Path
    """The task package on the deployer's machine: the build context."""
    repository: str
    builder: str = "acr"


class TaskImage(pulumi.ComponentResource):
    """The training image plus the user's package, built when either changes."""

    tag: str
    image_ref: pulumi.Output[str]

    def __init__(
        self, name: str, args: TaskImageArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        super().__init__("spot-lab:image:TaskImage", name, None, opts)
        tag = task_image_tag(args.base.tag, args.package_dir, args.project_dir / TASK_DOCKERFILE)
        self.tag = tag
        self.image_ref = pushed_image(
            self,
            name,
            args,
            tag,
            context=PACKAGE_ENV,
            dockerfile=TASK_DOCKERFILE,
            outside=True,
            # By the base's content tag, which the training image's build just pushed.
            build_args={"BASE_IMAGE": args.base.image_ref},
            # The package's path is the deployer's: in the environment, so that the command
            # itself is the same on every machine.
            environment={PACKAGE_ENV: str(args.package_dir)},
        )
        self.register_outputs({"tag": self.tag, "image_ref": self.image_ref})


def pushed_image(
    parent: pulumi.Resource,
    name: str,
    args: TrainingImageArgs | TaskImageArgs,
    tag: str,
    *,
    build_args: dict[str, pulumi.Input[str]] | None = None,
    environment: dict[str, str] | None = None,
    depends_on: list[pulumi.Resource] | None = None,
    **build: Any,
) -> pulumi.Output[str]:
    """Run ``build_command`` once per tag (a ``Command`` child of ``parent``); the image's
    reference, derived from the build's stdout so that nothing uses it before the push."""
    args_out = pulumi.Output.all(**(build_args or {}))
    create = pulumi.Output.all(
        args.registry_name, args.login_server, args.resource_group, args.subscription_id, args_out
    ).apply(
        lambda reg: build_command(
            args.builder,
            registry_name=reg[0],
            login_server=reg[1],
            resource_group=reg[2],
            subscription_id=reg[3],
            repository=args.repository,
            tag=tag,
            build_args=reg[4] or None,
            **build,
        )
    )
    built = command.local.Command(
        f"{name}-build",
        create=create,
        # No `dir`: an absolute path of this machine would be an input, so the same stack
        # run from a checkout elsewhere would rebuild. Unset, pulumi-command runs in its
        # working directory (local command runner: `cmd.Dir, err = os.Getwd()`), which the
        # engine sets to the project directory, where the relative context resolves.
        # A new tag (changed tree) replaces the command, which runs the build again.
        environment=environment,
        triggers=[tag],
        opts=pulumi.ResourceOptions(parent=parent, depends_on=depends_on or []),
    )
    return pulumi.Output.all(built.stdout, args.login_server).apply(
        lambda out: f"{out[1]}/{args.repository}:{tag}"
    )
