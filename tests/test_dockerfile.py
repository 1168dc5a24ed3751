"""The training image, checked without a Docker daemon: pins, user, layout and imports."""

from __future__ import annotations

import ast
import json
import re
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

TRAINING = Path(__file__).resolve().parents[1] / "training"
DOCKERFILE = TRAINING / "Dockerfile"
REQUIREMENTS = TRAINING / "requirements.txt"
DOCKERIGNORE = TRAINING / ".dockerignore"
BASE_IMAGE = "pytorch/pytorch"
# The distributions the image gets beyond its requirements: torch ships in the base image.
BASE_DISTRIBUTIONS = ("torch",)


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
    for node in ast.walk(ast.parse(source)):
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


def test_base_image_is_an_exact_pytorch_runtime_tag_matching_our_torch(
    instructions: list[tuple[str, str]],
) -> None:
    (base,) = _args(instructions, "FROM")
    image, _, tag = base.partition(":")
    assert image == BASE_IMAGE
    assert "@" not in tag and tag != "latest"
    match = re.fullmatch(r"(\d+\.\d+\.\d+)-cuda\d+\.\d+-cudnn\d+-runtime", tag)
    assert match, f"base tag {tag!r} is not an exact <torch>-cuda<x.y>-cudnn<n>-runtime tag"
    assert match[1] == metadata.version("torch").split("+")[0]


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
    assert {"python-etcd", "azure-storage-blob", "azure-identity"} <= pins.keys()
    assert "torch" not in pins, "torch comes from the base image; pinning it again reinstalls it"
    for name, version in pins.items():
        assert metadata.version(name) == version, f"{name}: image {version}, tests run another"


def test_every_training_import_is_available_in_the_image(pins: dict[str, str]) -> None:
    available: set[str] = set()
    for distribution in _closure([*pins, *BASE_DISTRIBUTIONS]):
        available |= _modules_of(distribution)
    missing: dict[str, set[str]] = {}
    for source in sorted(TRAINING.glob("*.py")):
        for module in imported_modules(source.read_text()):
            if module.split(".")[0] in sys.stdlib_module_names:
                continue
            if module not in available and module.split(".")[0] != "training":
                missing.setdefault(module, set()).add(source.name)
    assert not missing, f"imported by training/ but not in the image: {missing}"


def test_training_modules_exist_for_every_internal_import() -> None:
    own = {f"training.{p.stem}" for p in TRAINING.glob("*.py")} | {"training"}
    for source in TRAINING.glob("*.py"):
        internal = {m for m in imported_modules(source.read_text()) if m.startswith("training")}
        assert internal <= own, f"{source.name} imports {internal - own}"


def test_dockerignore_keeps_caches_out(instructions: list[tuple[str, str]]) -> None:
    patterns = {line.strip() for line in DOCKERIGNORE.read_text().splitlines()}
    assert {"__pycache__", "**/__pycache__", "*.py[cod]", ".pytest_cache"} <= patterns
    # requirements.txt is COPY'd by name: ignoring it would break the build.
    assert "requirements.txt" not in patterns


def test_parsers_reject_what_the_image_must_not_have() -> None:
    with pytest.raises(AssertionError, match="not pinned"):
        requirement_pins("azure-identity>=1.0\n")
    assert dockerfile_instructions("FROM a:1\nRUN x \\\n  && y\n# c\nUSER 1\n") == [
        ("FROM", "a:1"),
        ("RUN", "x && y"),
        ("USER", "1"),
    ]
    assert imported_modules("import a.b\nfrom c import d\nfrom . import e\n") == {"a.b", "c"}
