"""The training image's tag: what the build sees (``.dockerignore`` applied), and where it runs."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from catalog.build_context import context_files, is_ignored, parse_dockerignore
from infra.image import image_tag
from tests.support.pulumi_harness import PROJECT_DIR, run_program

TRAINING = PROJECT_DIR / "training"
PYTORCHJOB = "kubernetes:kubeflow.org/v1:PyTorchJob"


def _copy_training(tmp_path: Path) -> Path:
    copy = tmp_path / "training"
    shutil.copytree(TRAINING, copy, ignore=shutil.ignore_patterns("__pycache__", ".*_cache"))
    return copy


def _write(path: Path, text: str = "x\n") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.mark.parametrize(
    "ignored",
    [
        ".pytest_cache/v/cache/lastfailed",
        ".ruff_cache/0.17.5/123",
        ".mypy_cache/3.11/train.meta.json",
        "__pycache__/train.cpython-311.pyc",
        "sub/__pycache__/x.cpython-311.pyc",
        "stray.pyc",
        "sub/deep/stray.pyo",
        "spot_lab.egg-info/PKG-INFO",
    ],
)
def test_files_the_build_never_sees_do_not_change_the_tag(tmp_path: Path, ignored: str) -> None:
    copy = _copy_training(tmp_path)
    before = image_tag(copy)
    assert before == image_tag(TRAINING)
    _write(copy / ignored)
    assert image_tag(copy) == before


@pytest.mark.parametrize("change", ["dockerfile", "new-module", "nested", "requirements"])
def test_files_the_build_sees_change_the_tag(tmp_path: Path, change: str) -> None:
    copy = _copy_training(tmp_path)
    before = image_tag(copy)
    if change == "dockerfile":  # listed in .dockerignore, but it defines the image
        _write(copy / "Dockerfile", (copy / "Dockerfile").read_text() + "\n# changed\n")
    elif change == "new-module":
        _write(copy / "extra.py", "X = 1\n")
    elif change == "nested":
        _write(copy / "assets" / "labels.txt")
    else:
        _write(copy / "requirements.txt", (copy / "requirements.txt").read_text() + "\n")
    assert image_tag(copy) != before


def test_the_ignore_list_is_read_from_the_contexts_dockerignore(tmp_path: Path) -> None:
    copy = _copy_training(tmp_path)
    _write(copy / "NOTES.md", "scratch\n")
    with_notes = image_tag(copy)
    ignore = copy / ".dockerignore"
    ignore.write_text(ignore.read_text() + "\n# local scratch, not for the image\nNOTES.md\n")
    without_notes = image_tag(copy)
    assert without_notes != with_notes
    (copy / "NOTES.md").unlink()
    # .dockerignore lists itself: the build never copies it, so its own edit is not content.
    assert image_tag(copy) == without_notes


def test_the_real_context_is_the_package_its_requirements_and_the_dockerfile() -> None:
    names = {p.relative_to(TRAINING).as_posix() for p in context_files(TRAINING)}
    assert {"Dockerfile", "requirements.txt", "__init__.py", "train.py"} <= names
    assert ".dockerignore" not in names
    assert not any("__pycache__" in n or n.endswith(".pyc") for n in names)


def test_an_ignored_folder_is_not_walked_unless_a_line_takes_something_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write(tmp_path / "mytask" / "model.py", "spec = None\n")
    _write(tmp_path / "data" / "shard" / "0.bin", "x")
    _write(tmp_path / "data" / "keep.txt", "x")
    scanned: list[str] = []
    real = os.scandir

    def scandir(path: Any) -> Any:
        scanned.append(Path(path).relative_to(tmp_path).as_posix())
        return real(path)

    monkeypatch.setattr(os, "scandir", scandir)
    (tmp_path / ".dockerignore").write_text("data\n")
    assert [p.name for p in context_files(tmp_path, "")] == [".dockerignore", "model.py"]
    assert not any(s.startswith("data") for s in scanned)  # Docker skips it too
    (tmp_path / ".dockerignore").write_text("data\n!data/keep.txt\n")
    assert [p.name for p in context_files(tmp_path, "")] == [
        ".dockerignore",
        "keep.txt",
        "model.py",
    ]


@pytest.mark.parametrize(
    ("path", "ignored"),
    [
        ("a.pyc", True),  # "*.pyc" matches at the root only ...
        ("pkg/a.pyc", False),
        ("pkg/a.pyo", True),  # ... "**/*.pyo" at any depth
        ("build", True),  # "/build": leading '/' is the context root
        ("build/out/x.o", True),  # a matched directory excludes everything below it
        ("src/build", False),
        ("docs/guide.md", True),
        ("docs/keep.md", False),  # "!docs/keep.md" re-includes, the last match wins
        ("x/cache", True),  # "*/cache": '*' is one path segment
        ("x/y/cache", False),
        ("data1.bin", True),  # '?' is one character, '[0-9]' a class
        ("data12.bin", False),
    ],
)
def test_dockerignore_rules_follow_docker(path: str, ignored: bool) -> None:
    patterns = parse_dockerignore(
        "# comment\n\n*.pyc\n**/*.pyo\n/build\ndocs/**\n!docs/keep.md\n*/cache\ndata[0-9]?bin\n"
    )
    assert is_ignored(path, patterns) is ignored


def test_the_build_runs_in_the_project_dir_and_the_job_uses_its_tag() -> None:
    run = run_program("dev")
    tag = image_tag(TRAINING)
    build = run.one("command:local:Command", "training-image-build")
    assert "dir" not in build.inputs  # the engine runs it in the project directory
    assert f"spot-lab-trainer:{tag} --build-arg BASE_REGISTRY=" in build.inputs["create"]
    assert build.inputs["create"].endswith(".azurecr.io training")
    assert run.outputs["imageTag"] == tag
    worker = run.one(PYTORCHJOB).inputs["spec"]["pytorchReplicaSpecs"]["Worker"]
    (container,) = worker["template"]["spec"]["containers"]
    assert container["image"] == run.outputs["image"]
    assert container["image"].endswith(f"/spot-lab-trainer:{tag}")


def test_the_staging_job_runs_the_slim_image_built_from_the_same_tree() -> None:
    run = run_program("dev")
    tag = image_tag(TRAINING, "Dockerfile.stager")
    build = run.one("command:local:Command", "stager-image-build")
    # az acr build reads --file from the working directory, not the context (azure-cli,
    # command_modules/acr/build.py: "Otherwise, it's based on current working directory"), and
    # fails with "Unable to find 'Dockerfile.stager'" when it is not there.
    assert (
        f"--image spot-lab-stager:{tag} --file training/Dockerfile.stager --build-arg"
        in (build.inputs["create"])
    )
    staging = run.one("kubernetes:batch/v1:Job").inputs["spec"]["template"]["spec"]
    (container,) = staging["containers"]
    assert container["image"] == run.outputs["stagerImage"]
    assert container["image"].endswith(f"/spot-lab-stager:{tag}")
    # The workers keep the CUDA image.
    assert run.outputs["image"].endswith(f"/spot-lab-trainer:{image_tag(TRAINING)}")


def test_each_tag_follows_its_own_dockerfile(tmp_path: Path) -> None:
    copy = _copy_training(tmp_path)
    training, stager = image_tag(copy), image_tag(copy, "Dockerfile.stager")
    assert training != stager
    with open(copy / "Dockerfile.stager", "a") as f:
        f.write("\n# changed\n")
    assert image_tag(copy, "Dockerfile.stager") != stager
    with open(copy / "train.py", "a") as f:
        f.write("\n# changed\n")
    assert image_tag(copy) != training  # the code is in both images


def test_a_local_docker_build_names_the_stager_dockerfile_from_the_project_dir() -> None:
    run = run_program("dev", {"imageBuilder": "docker"})
    create = run.one("command:local:Command", "stager-image-build").inputs["create"]
    assert "--file training/Dockerfile.stager --build-arg BASE_REGISTRY=" in create
