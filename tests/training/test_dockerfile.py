"""The training and staging images, checked without a Docker daemon: pins, user, layout and
imports."""

from __future__ import annotations

import ast
import json
import re
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from catalog.base_images import (
    AKS_GPU_DRIVER_BRANCH,
    DOCKER_HUB,
    TORCH_CUDA_BUILDS,
    dockerfile_bases,
    parse_image_ref,
    runs_on_aks_driver,
    training_base_images,
)
from training import python_source

TRAINING = Path(__file__).resolve().parents[2] / "training"
DOCKERFILE = TRAINING / "Dockerfile"
STAGER_DOCKERFILE = TRAINING / "Dockerfile.stager"
REQUIREMENTS = TRAINING / "requirements.txt"
DOCKERIGNORE = TRAINING / ".dockerignore"
BASE_IMAGE = "library/python"
# The distributions the image gets beyond its requirements: torch, installed by the Dockerfile
# from PyTorch's own index.
BASE_DISTRIBUTIONS = ("torch",)
CUDA_INDEX = re.compile(r"--index-url https://download\.pytorch\.org/whl/cu(\d+)(\d) torch==(\S+)")


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with comments dropped and continuations joined."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, args = (pending + line).partition(" ")
        instructions.append((keyword.upper(), " ".join(args.split())))
        pending = ""
    assert not pending, "Dockerfile ends inside a line continuation"
    return instructions


def requirement_pins(text: str) -> dict[str, str]:
    """{distribution: version} from a requirements file; fails on anything not ``==``."""
    pins: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][0-9A-Za-z.+!-]*)", line)
        assert match, f"requirement {line!r} is not pinned as name==version"
        pins[match[1].lower()] = match[2]
    return pins


def _closure(roots: list[str]) -> set[str]:
    """The roots and every distribution they require (extras off), as installed here."""
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        name = todo.pop().lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        for spec in metadata.requires(name) or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def _modules_of(distribution: str) -> set[str]:
    """Dotted module and package names a distribution installs, from its RECORD."""
    modules: set[str] = set()
    for file in metadata.files(distribution) or []:
        parts = file.parts
        if not file.name.endswith((".py", ".so", ".pyd")) or ".dist-info" in parts[0]:
            continue
        stem = file.name.split(".", 1)[0]
        dotted = [*parts[:-1]] if stem == "__init__" else [*parts[:-1], stem]
        modules.update(".".join(dotted[:i]) for i in range(1, len(dotted) + 1))
    return modules


def imported_modules(source: str) -> set[str]:
    """Absolute modules a source file imports anywhere (top level and inside functions)."""
    found: set[str] = set()
    for node in ast.walk(python_source.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
    found.discard("__future__")
    return found


@pytest.fixture(scope="module")
def instructions() -> list[tuple[str, str]]:
    return dockerfile_instructions(DOCKERFILE.read_text())


@pytest.fixture(scope="module")
def pins() -> dict[str, str]:
    return requirement_pins(REQUIREMENTS.read_text())


def _args(instructions: list[tuple[str, str]], keyword: str) -> list[str]:
    return [args for kw, args in instructions if kw == keyword]


def test_the_base_is_the_stagers_slim_python_and_torch_its_cuda12_build(
    instructions: list[tuple[str, str]], stager: list[tuple[str, str]]
) -> None:
    """torch's CUDA wheels bring the CUDA libraries (nvidia-*-cu12), so the base needs none: the
    slim Python the tests run, pinned by digest, the staging image's. torch 2.13's CUDA builds
    are 12.6 and 13.0 (RELEASE.md; the default PyPI wheel requires cuda-toolkit 13.0.3), and
    AKS's GPU driver branch (570, Azure/AKS #5207) runs CUDA 12.x only (13.x needs 580). lab
    preflight resolves the base against Docker Hub before anything is created
    (catalog/base_images.py)."""
    (base,) = _args(instructions, "FROM")
    (ref,) = dockerfile_bases(DOCKERFILE.read_text())
    # Named through the build argument the build points at the lab's registry, where `pulumi
    # up` imported this digest first; by hand, Docker Hub.
    assert base.startswith("${BASE_REGISTRY}/library/python:") and ref.imported
    assert (ref.registry, ref.repository) == (DOCKER_HUB, BASE_IMAGE)
    assert ref.tag.startswith(f"{sys.version_info.major}.{sys.version_info.minor}-slim")
    assert ref.digest.startswith("sha256:")
    assert _args(stager, "FROM") == [base]
    (install,) = [m for run in _args(instructions, "RUN") if (m := CUDA_INDEX.search(run))]
    cuda, torch_version = f"{install[1]}.{install[2]}", install[3]
    assert torch_version == metadata.version("torch").split("+")[0]
    assert cuda in TORCH_CUDA_BUILDS[torch_version]
    assert runs_on_aks_driver(cuda, AKS_GPU_DRIVER_BRANCH)
    assert not runs_on_aks_driver("13.0", AKS_GPU_DRIVER_BRANCH)


def test_the_build_checks_the_pinned_torch_and_cuda_and_the_driver_is_mounted(
    instructions: list[tuple[str, str]],
) -> None:
    runs = _args(instructions, "RUN")
    (check,) = [run for run in runs if "torch.version.cuda" in run]
    assert "'2.13.0'" in check and "['12', '6']" in check
    # The check runs on what the install put there, before anything else is added.
    install = next(i for i, run in enumerate(runs) if CUDA_INDEX.search(run))
    assert runs.index(check) == install + 1
    # The container runtime mounts the driver's compute libraries only when asked (NVIDIA
    # Container Toolkit, NVIDIA_DRIVER_CAPABILITIES); PyTorch's own images set the same.
    (env,) = _args(instructions, "ENV")
    assert "NVIDIA_DRIVER_CAPABILITIES=compute,utility" in env


def test_runs_as_a_numeric_non_root_user(instructions: list[tuple[str, str]]) -> None:
    users = _args(instructions, "USER")
    assert users, "the image must switch to a non-root USER"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"USER {users[-1]!r} is not a numeric non-root uid"
    last_user = max(i for i, (kw, _) in enumerate(instructions) if kw == "USER")
    assert all(kw != "RUN" for kw, _ in instructions[last_user:])


def test_layout_lets_torchrun_find_the_training_package(
    instructions: list[tuple[str, str]],
) -> None:
    assert _args(instructions, "WORKDIR")[-1] == "/app"
    assert ". /app/training/" in _args(instructions, "COPY")
    assert not _args(instructions, "ENTRYPOINT")
    (cmd,) = _args(instructions, "CMD")
    assert json.loads(cmd)[0] == "torchrun"


def test_requirements_are_installed_and_pinned_to_what_the_tests_run(
    instructions: list[tuple[str, str]], pins: dict[str, str]
) -> None:
    assert "requirements.txt /tmp/requirements.txt" in _args(instructions, "COPY")
    assert any("pip install -r /tmp/requirements.txt" in run for run in _args(instructions, "RUN"))
    assert {"etcd3gw", "azure-storage-blob", "azure-identity"} <= pins.keys()
    assert not {"python-etcd", "urllib3", "dnspython"} & pins.keys()  # the v2 client's
    assert "torch" not in pins, "torch comes from PyTorch's CUDA index; PyPI's would be CUDA 13"
    for name, version in pins.items():
        assert metadata.version(name) == version, f"{name}: image {version}, tests run another"


def test_every_training_import_is_available_in_the_image(pins: dict[str, str]) -> None:
    available: set[str] = set()
    for distribution in _closure([*pins, *BASE_DISTRIBUTIONS]):
        available |= _modules_of(distribution)
    missing: dict[str, set[str]] = {}
    for source in sorted(TRAINING.rglob("*.py")):
        for module in imported_modules(source.read_text()):
            if module.split(".")[0] in sys.stdlib_module_names:
                continue
            if module not in available and module.split(".")[0] != "training":
                missing.setdefault(module, set()).add(str(source.relative_to(TRAINING)))
    assert not missing, f"imported by training/ but not in the image: {missing}"


def _module_name(path: Path) -> str:
    """``training/data/cifar10.py`` -> ``training.data.cifar10``; a package by its own name."""
    parts = path.relative_to(TRAINING.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _source(module: str) -> Path:
    """The file of ``training.<module>``: the module's, or the package's ``__init__.py``."""
    path = TRAINING.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def test_training_modules_exist_for_every_internal_import() -> None:
    own = {_module_name(p) for p in TRAINING.rglob("*.py")}
    for source in TRAINING.rglob("*.py"):
        internal = {m for m in imported_modules(source.read_text()) if m.startswith("training")}
        assert internal <= own, f"{source.relative_to(TRAINING)} imports {internal - own}"


def test_dockerignore_keeps_caches_out(instructions: list[tuple[str, str]]) -> None:
    patterns = {line.strip() for line in DOCKERIGNORE.read_text().splitlines()}
    assert {"__pycache__", "**/__pycache__", "*.py[cod]", ".pytest_cache"} <= patterns
    # requirements.txt is COPY'd by name: ignoring it would break the build.
    assert "requirements.txt" not in patterns


def test_the_image_holds_every_task_and_the_corpus_sample() -> None:
    """The build context is training/ whole (``COPY . /app/training/``): each registered task's
    module and the corpus excerpt the lab trains on are in it, and none is ignored."""
    import fnmatch
    import inspect

    from training.tasks import TASKS

    patterns = [
        p.strip() for p in DOCKERIGNORE.read_text().splitlines() if p.strip()[:1] not in "#"
    ]
    sample = TRAINING / "data" / "samples" / "tinyshakespeare" / "input.txt"
    files = [Path(inspect.getfile(spec.loss)) for spec in TASKS.values()] + [sample]
    assert {"cifar", "charlm"} <= set(TASKS)
    for path in files:
        relative = path.resolve().relative_to(TRAINING).as_posix()
        assert path.is_file() and not any(fnmatch.fnmatch(relative, p) for p in patterns)


def test_parsers_reject_what_the_image_must_not_have() -> None:
    with pytest.raises(AssertionError, match="not pinned"):
        requirement_pins("azure-identity>=1.0\n")
    assert dockerfile_instructions("FROM a:1\nRUN x \\\n  && y\n# c\nUSER 1\n") == [
        ("FROM", "a:1"),
        ("RUN", "x && y"),
        ("USER", "1"),
    ]
    assert imported_modules("import a.b\nfrom c import d\nfrom . import e\n") == {"a.b", "c"}


# ---- the staging image ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stager() -> list[tuple[str, str]]:
    return dockerfile_instructions(STAGER_DOCKERFILE.read_text())


def test_the_stager_is_slim_python_with_the_cpu_build_of_our_torch(
    stager: list[tuple[str, str]], pins: dict[str, str]
) -> None:
    (ref,) = dockerfile_bases(STAGER_DOCKERFILE.read_text())
    assert ref.imported
    assert (ref.registry, ref.repository) == (DOCKER_HUB, "library/python")
    assert ref.tag.startswith(f"{sys.version_info.major}.{sys.version_info.minor}-slim")
    assert ref.digest.startswith("sha256:")
    runs = _args(stager, "RUN")
    torch_version = metadata.version("torch").split("+")[0]
    assert any(
        "--index-url https://download.pytorch.org/whl/cpu" in run
        and f"torch=={torch_version}" in run
        for run in runs
    ), "the stager must install torch's CPU build of the release the tests run"
    # The same pinned requirements as the training image.
    assert "requirements.txt /tmp/requirements.txt" in _args(stager, "COPY")
    assert any("pip install -r /tmp/requirements.txt" in run for run in runs)
    assert not [run for run in runs if "cuda" in run.lower()]


def test_the_stager_runs_stage_data_as_a_non_root_user(stager: list[tuple[str, str]]) -> None:
    uid = _args(stager, "USER")[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0
    assert _args(stager, "WORKDIR")[-1] == "/app"
    assert ". /app/training/" in _args(stager, "COPY")
    (cmd,) = _args(stager, "CMD")
    assert json.loads(cmd)[:3] == ["python", "-m", "training.data.stage_data"]


def _training_imports(module: str) -> set[str]:
    """Modules ``training.<module>`` imports, following our own modules transitively."""
    seen: set[str] = set()
    todo, external = [module], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for imported in imported_modules(_source(name).read_text()):
            if imported.startswith("training."):
                todo.append(imported.split(".", 1)[1])
            elif imported != "training" and imported.split(".")[0] not in sys.stdlib_module_names:
                external.add(imported)
    return external


def test_everything_stage_data_imports_is_in_the_stager(pins: dict[str, str]) -> None:
    available: set[str] = set()
    for distribution in _closure([*pins, *BASE_DISTRIBUTIONS]):
        available |= _modules_of(distribution)
    needed = _training_imports("data.stage_data")
    assert {"torch", "azure.storage.blob"} <= {m.split(".")[0] for m in needed} | needed
    assert needed <= available, needed - available


def test_every_base_is_listed_for_preflight() -> None:
    bases = training_base_images(TRAINING)
    assert sorted(bases) == ["Dockerfile", "Dockerfile.stager"]
    assert [b.repository for b in bases["Dockerfile"]] == [BASE_IMAGE]
    assert bases["Dockerfile.stager"] == bases["Dockerfile"]
    for images in bases.values():
        assert all(image.digest and image.tag for image in images)


@pytest.mark.parametrize(
    ("text", "registry", "repository", "tag", "digest"),
    [
        ("python:3.11-slim", DOCKER_HUB, "library/python", "3.11-slim", ""),
        ("pytorch/pytorch", DOCKER_HUB, "pytorch/pytorch", "latest", ""),
        ("docker.io/pytorch/pytorch:2.13.0", DOCKER_HUB, "pytorch/pytorch", "2.13.0", ""),
        ("nvcr.io/nvidia/pytorch:25.01-py3", "nvcr.io", "nvidia/pytorch", "25.01-py3", ""),
        ("localhost:5000/x:1@sha256:" + "a" * 64, "localhost:5000", "x", "1", "sha256:" + "a" * 64),
    ],
)
def test_image_references_split_as_docker_does(
    text: str, registry: str, repository: str, tag: str, digest: str
) -> None:
    ref = parse_image_ref(text)
    assert (ref.registry, ref.repository, ref.tag, ref.digest) == (
        registry,
        repository,
        tag,
        digest,
    )


def test_stages_built_on_stages_are_not_bases() -> None:
    text = "FROM --platform=linux/amd64 python:3.11 AS build\nFROM build\nFROM busybox:1 AS x\n"
    assert [b.repository for b in dockerfile_bases(text)] == ["library/python", "library/busybox"]
    with pytest.raises(ValueError, match="sha256:<64 hex digits>"):
        parse_image_ref("python:3.11@sha256:abc")


def test_the_training_image_carries_the_rdma_userspace_nccl_loads(
    instructions: list[tuple[str, str]], stager: list[tuple[str, str]]
) -> None:
    """libibverbs and its mlx5 provider, pinned to bookworm's rdma-core (the base's release),
    in the workers' image only; the build checks the provider is where libibverbs loads it."""
    (install,) = [run for run in _args(instructions, "RUN") if "libibverbs1" in run]
    assert "libibverbs1=44.0-2" in install and "ibverbs-providers=44.0-2" in install
    assert "--no-install-recommends" in install and "rm -rf /var/lib/apt/lists/*" in install
    assert "libibverbs/libmlx5-rdmav34.so" in install
    assert not [run for run in _args(stager, "RUN") if "libibverbs" in run]
    users = [i for i, (kw, _) in enumerate(instructions) if kw == "USER"]
    assert instructions.index(("RUN", install)) < min(users)  # installed as root
