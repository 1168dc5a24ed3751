"""The dependencies are declared where they are used.

``requirements.txt`` is what ``pulumi up`` installs: the Pulumi program must import with it
alone. A fresh interpreter refuses every package the other requirements files add (the
training image's, the lab's and the tests'), and imports what ``__main__.py`` imports.
"""

from __future__ import annotations

import ast
import importlib.metadata
import subprocess
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.support.lab_runs import fresh_python
from training import python_source

REPO_ROOT = Path(__file__).resolve().parents[1]
PROGRAM_REQUIREMENTS = REPO_ROOT / "requirements.txt"
OTHER_REQUIREMENTS = (REPO_ROOT / "requirements-dev.txt", REPO_ROOT / "training/requirements.txt")


def direct_requirements(path: Path) -> list[Requirement]:
    """A requirements file's own lines, ``-r`` files left out."""
    lines = (line.split("#")[0].strip() for line in path.read_text().splitlines())
    return [Requirement(line) for line in lines if line and not line.startswith("-r")]


def requirements(path: Path) -> dict[str, Requirement]:
    """A requirements file's requirements by distribution name, ``-r`` files included."""
    found: dict[str, Requirement] = {}
    for line in path.read_text().splitlines():
        if line.startswith("-r"):
            found |= requirements(path.parent / line.removeprefix("-r").split("#")[0].strip())
    return found | {canonicalize_name(r.name): r for r in direct_requirements(path)}


def installed_with(names: set[str]) -> set[str]:
    """``names`` and every distribution they require, as installed (extras left out)."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for text in importlib.metadata.requires(name) or []:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(canonicalize_name(requirement.name))
    return seen


def blocked_imports() -> set[str]:
    """The top-level import names that only the other requirements files install, directly or
    as a dependency of theirs."""
    program = installed_with(set(requirements(PROGRAM_REQUIREMENTS)))
    listed = set().union(*(requirements(path) for path in OTHER_REQUIREMENTS))
    others = installed_with(listed) - program
    blocked = set()
    for module, distributions in importlib.metadata.packages_distributions().items():
        names = {canonicalize_name(d) for d in distributions}
        if names & others and not names & program:
            blocked.add(module)
    return blocked


def program_imports() -> list[str]:
    """The modules ``__main__.py`` (the Pulumi program) imports."""
    tree = python_source.parse((REPO_ROOT / "__main__.py").read_text())
    found = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module != "__future__":
            found.append(node.module)
    return found


REFUSING = """
import importlib, sys
from importlib.abc import MetaPathFinder

class Refuse(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"{name} is not in requirements.txt", name=name)
        return None

sys.meta_path.insert(0, Refuse())
for module in MODULES:
    importlib.import_module(module)
print("imported", len(MODULES))
"""


def import_refusing(modules: list[str], blocked: set[str]) -> subprocess.CompletedProcess[str]:
    code = f"BLOCKED = {sorted(blocked)!r}\nMODULES = {modules!r}\n{REFUSING}"
    return fresh_python("-c", code, timeout_s=300)


def test_kubernetes_is_pinned_directly_at_a_version_kubeflow_accepts() -> None:
    """``lab watch``, ``drill`` and ``rebalance`` import the client: a pin of its own, not one
    that arrives unpinned through the schema checks' ``kubeflow-training``."""
    dev = REPO_ROOT / "requirements-dev.txt"
    pinned = requirements(dev)["kubernetes"]
    assert "kubernetes" in {canonicalize_name(r.name) for r in direct_requirements(dev)}
    installed = importlib.metadata.version("kubernetes")
    assert str(pinned.specifier) == f"=={installed}"
    wanted = [Requirement(r) for r in importlib.metadata.requires("kubeflow-training") or []]
    assert any(r.name == "kubernetes" and installed in r.specifier for r in wanted)
    users = [p for p in (REPO_ROOT / "lab").rglob("*.py") if "from kubernetes" in p.read_text()]
    assert users  # the pin's reason still holds


def test_the_blocked_list_comes_from_the_requirements_files() -> None:
    blocked = blocked_imports()
    # What the image, the lab and the tests add; none of what pulumi up installs.
    assert {"torch", "numpy", "azure", "kubernetes", "matplotlib", "etcd3gw", "pytest"} <= blocked
    assert not {"pulumi", "pulumi_azure_native", "pulumi_kubernetes", "yaml"} & blocked
    assert "stack_config" in program_imports() and "pulumi" in program_imports()


@pytest.mark.usefixtures("processes")
def test_the_refusal_refuses() -> None:
    """A blocked package fails to import in the subprocess: the next test can fail."""
    result = import_refusing(["lab.azure.clients"], blocked_imports())
    assert result.returncode != 0
    assert "is not in requirements.txt" in result.stderr


@pytest.mark.usefixtures("processes")
def test_the_pulumi_program_imports_with_requirements_txt_alone() -> None:
    result = import_refusing(program_imports(), blocked_imports())
    assert result.returncode == 0, result.stderr
    assert f"imported {len(program_imports())}" in result.stdout
