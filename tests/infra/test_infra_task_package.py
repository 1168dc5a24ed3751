"""Your own training job through ``pulumi up``, under mocks: a task package written outside the
repository, its image, its settings, and what ``up`` refuses before anything is created."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from catalog.build_context import context_files
from infra.image import TASK_DOCKERFILE, image_tag, task_image_tag
from tests.support.pulumi_harness import PROJECT_DIR, AzureAnswers, ProgramRun, run_program
from tests.support.user_package import write_user_package
from workloads.job import ConfigRefused

PYTORCHJOB = "kubernetes:kubeflow.org/v1:PyTorchJob"
COMMAND = "command:local:Command"
RECORD = "workloads-job-run-1"
TRAIN_ARGS = {"lr": 0.02, "micro-batch-size": 16, "width": 32}


@pytest.fixture
def package(tmp_path: Path) -> Path:
    package = write_user_package(tmp_path)
    # What the package's .dockerignore keeps out: history, data, a virtualenv.
    for name, text in {
        ".git/HEAD": "ref: refs/heads/main\n",
        "data/points.pt": "not for the image",
        ".venv/pyvenv.cfg": "home = /usr/bin\n",
    }.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(text)
    return package


def _overrides(package: Path, **more: Any) -> dict[str, str]:
    values: dict[str, Any] = {
        "task": "mytask.model:spec",
        "taskPackage": str(package),
        "dataSourceUrl": "none",
        "trainArgs": TRAIN_ARGS,
        **more,
    }
    return {k: json.dumps(v) if isinstance(v, dict) else str(v) for k, v in values.items()}


def _run(package: Path, answers: AzureAnswers | None = None, **more: Any) -> ProgramRun:
    return run_program("dev", _overrides(package, **more), answers=answers, fresh=True, check=False)


def _container(run: ProgramRun) -> dict[str, Any]:
    worker = run.one(PYTORCHJOB).inputs["spec"]["pytorchReplicaSpecs"]["Worker"]
    (container,) = worker["template"]["spec"]["containers"]
    return container


def _env(run: ProgramRun) -> dict[str, str]:
    return {e["name"]: e["value"] for e in _container(run)["env"]}


def _refusal(run: ProgramRun) -> str:
    assert isinstance(run.error, ConfigRefused), run.error
    (problem,) = run.error.problems
    assert "\n" not in problem
    return problem


def test_the_image_is_the_training_image_plus_the_package(package: Path) -> None:
    run = _run(package)
    assert run.error is None
    build = run.one(COMMAND, "task-image-build")
    base = run.outputs["trainingImage"]
    assert base.endswith(f"/spot-lab-trainer:{image_tag(PROJECT_DIR / 'training')}")
    tag = task_image_tag(base.rsplit(":", 1)[1], package, PROJECT_DIR / TASK_DOCKERFILE)
    assert build.inputs["create"].endswith(
        f"--image spot-lab-task:{tag} --file {TASK_DOCKERFILE} "
        f"--build-arg BASE_IMAGE={base} " + '"${TASK_PACKAGE_DIR}"'
    )
    assert build.inputs["environment"] == {"TASK_PACKAGE_DIR": str(package)}
    assert build.inputs["triggers"] == [tag]
    # The build context: the package and its requirements, not what .dockerignore leaves out.
    sent = {p.relative_to(package).as_posix() for p in context_files(package, dockerfile="")}
    assert sent == {".dockerignore", "requirements.txt", "mytask/__init__.py", "mytask/model.py"}
    assert _container(run)["image"] == run.outputs["image"]
    assert run.outputs["image"].endswith(f"/spot-lab-task:{tag}")


def test_the_task_dockerfile_adds_one_package_to_the_pinned_image_as_non_root() -> None:
    lines = [
        line.strip()
        for line in (PROJECT_DIR / TASK_DOCKERFILE).read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert lines[:2] == ["ARG BASE_IMAGE", "FROM ${BASE_IMAGE}"]
    assert "COPY . /app/" in lines
    assert lines[-1] == "USER 10001:10001"  # the training image's own user
    text = "\n".join(lines)
    assert "pip install -r /app/requirements.txt -c /tmp/lab-image.txt" in text


def test_the_tag_follows_the_packages_code_and_nothing_else(package: Path) -> None:
    first = _run(package)
    (package / "data" / "points.pt").write_text("other data, not in the image")
    (package / ".git" / "HEAD").write_text("ref: refs/heads/other\n")
    same = _run(package)
    assert same.outputs["image"] == first.outputs["image"]
    assert same.outputs["rdzvId"] == first.outputs["rdzvId"]  # the job is not replaced
    with open(package / "mytask" / "model.py", "a") as f:
        f.write("\n# a change of the user's code\n")
    changed = _run(package)
    assert changed.outputs["image"] != first.outputs["image"]
    assert _container(changed)["image"] == changed.outputs["image"]
    assert changed.outputs["rdzvId"] != first.outputs["rdzvId"]  # a new job
    (package / "requirements.txt").write_text("tomli==2.2.0\n")
    assert _run(package).outputs["image"] != changed.outputs["image"]


def test_the_worker_command_carries_the_train_args(package: Path) -> None:
    command = _container(_run(package))["command"]
    assert command[:5] == ["python", "-m", "training.agent", "--module", "training.train"]
    assert "--task=mytask.model:spec" in command
    assert command[-3:] == ["--lr=0.02", "--micro-batch-size=16", "--width=32"]


@pytest.mark.parametrize(
    ("more", "expected"),
    [
        (
            {"task": "mytask.missing:spec"},
            "spot-lab:task mytask.missing:spec cannot be imported from spot-lab:taskPackage",
        ),
        (
            {"trainArgs": {"widht": 32}},
            "spot-lab:trainArgs.widht is neither a flag of the training loop nor an option of "
            "spot-lab:task mytask.model:spec (did you mean width?)",
        ),
        ({"trainArgs": {"max-steps": 5}}, "which the stack key spot-lab:maxSteps sets too"),
    ],
)
def test_a_refusal_is_one_line_and_nothing_is_created(
    package: Path, more: dict[str, Any], expected: str
) -> None:
    run = _run(package, **more)
    assert expected in _refusal(run)
    assert run.resources == []


def test_a_dockerignore_line_az_acr_build_reads_otherwise_is_refused(package: Path) -> None:
    # azure-cli's acr _archive_utils.py keeps the '/' of `data/` in its pattern, which then
    # matches no path: the data would go into the image while the tag says it stayed out.
    (package / ".dockerignore").write_text(".git\ndata/\n/.venv\n!mytask/\n")
    run = _run(package)
    assert isinstance(run.error, ConfigRefused) and run.resources == []
    assert [p.rpartition(": ")[2] for p in run.error.problems] == ["write 'data'", "write '.venv'"]
    assert all("az acr build matches nothing with the line" in p for p in run.error.problems)
    assert _run(package, imageBuilder="docker").error is None  # Docker's own rules strip it


def test_a_double_star_line_that_az_reads_wider_than_docker_is_refused(package: Path) -> None:
    # azure-cli turns '**/' into '.*' with no '/' after it: '**/data' is every name ending in
    # 'data', and the package's own mytask/metadata/ would be missing from the image.
    (package / "mytask" / "metadata").mkdir()
    (package / "mytask" / "metadata" / "__init__.py").write_text("")
    (package / ".dockerignore").write_text(".git\n.venv\n**/__pycache__\n**/data\n")
    (problem,) = _run(package).error.problems  # type: ignore[union-attr]
    assert "'**/data' as any name ending in data" in problem
    assert "mytask/metadata/__init__.py out of the image" in problem
    (package / "mytask" / "metadata" / "__init__.py").unlink()
    (package / "mytask" / "metadata").rmdir()
    assert _run(package).error is None  # nothing else ends in 'data' but data/ itself


def _recorded(run: ProgramRun) -> AzureAnswers:
    """The state an earlier ``up`` of ``run`` left: its run's record."""
    record = run.one("kubernetes:core/v1:ConfigMap", RECORD)
    return AzureAnswers(kept_inputs={RECORD: {"data": record.inputs["data"]}})


def test_a_shape_change_without_a_new_run_id_is_refused_before_the_job(package: Path) -> None:
    started = _run(package)
    record = started.one("kubernetes:core/v1:ConfigMap", RECORD)
    assert record.ignore_changes == ["data"]  # the engine keeps what the run started with
    wider = _run(package, _recorded(started), trainArgs={**TRAIN_ARGS, "width": 64})
    assert _refusal(wider).startswith("spot-lab:trainArgs.width was 32, now 64: ")
    assert "set spot-lab:runId to a new value" in _refusal(wider)
    assert wider.of_type(PYTORCHJOB) == []  # the running job is not touched


def test_a_new_run_id_starts_a_new_run_in_a_folder_of_its_own(package: Path) -> None:
    started = _run(package)
    new_run = _run(package, _recorded(started), trainArgs={**TRAIN_ARGS, "width": 64}, runId="2")
    assert new_run.error is None
    assert new_run.one("kubernetes:core/v1:ConfigMap").name == "workloads-job-run-2"
    old, new = started.outputs["checkpointUri"], new_run.outputs["checkpointUri"]
    assert old.rsplit("/", 1)[0] == new.rsplit("/", 1)[0].rstrip("/")  # both in the job's folder
    assert old != new and _env(new_run)["TRAIN_CHECKPOINT_URI"] == new


def test_a_resumable_change_rolls_the_job_onto_the_same_checkpoints(package: Path) -> None:
    started = _run(package)
    lower = _run(package, _recorded(started), trainArgs={**TRAIN_ARGS, "lr": 0.005})
    assert lower.error is None
    assert lower.outputs["rdzvId"] != started.outputs["rdzvId"]  # a new job, which resumes
    assert lower.outputs["checkpointUri"] == started.outputs["checkpointUri"]
    assert "--lr=0.005" in _container(lower)["command"]


def test_a_plain_torchrun_script_runs_with_the_same_rendezvous_and_image(package: Path) -> None:
    (package / "scripts").mkdir()
    (package / "scripts" / "train_ddp.py").write_text("import torch.distributed\n")
    run = _run(
        package,
        launcher="torchrun",
        script="scripts/train_ddp.py",
        trainArgs={"epochs": 3, "amp": True},
    )
    container = _container(run)
    assert container["command"] == [
        "python",
        "-m",
        "training.agent",
        "scripts/train_ddp.py",
        "--amp",
        "--epochs=3",
    ]
    assert _env(run)["TRAIN_LAUNCHER"] == "torchrun"
    assert container["image"] == run.outputs["image"]
    loop = _run(package)
    policy = run.one(PYTORCHJOB).inputs["spec"]["elasticPolicy"]
    assert policy["rdzvHost"] == loop.one(PYTORCHJOB).inputs["spec"]["elasticPolicy"]["rdzvHost"]


def test_a_data_prefix_is_the_workers_source_and_the_upload_target(package: Path) -> None:
    run = _run(package, dataPrefix="points/v2")
    assert _env(run)["TRAIN_DATA_URI"] == "/mnt/dataset/points/v2"
    assert run.outputs["dataUri"].endswith(".blob.core.windows.net/data/points/v2")
    # Nothing stages the user's data: the job is created and its workers wait for the upload.
    assert run.of_type("kubernetes:batch/v1:Job") == [] and run.of_type(PYTORCHJOB)


def test_destroy_keeps_the_checkpoints_and_says_where(package: Path) -> None:
    run = _run(package)
    kept = {r.name for r in run.resources if r.retain_on_delete}
    assert kept == {
        "lab-rg",  # azure-native deletes a group with all it holds
        "storage-account",
        "storage-checkpoints",
        "storage-deployer-checkpoints-reader",
    }
    note = run.outputs["keptOnDestroy"]
    assert run.outputs["checkpointUri"] in note and "az group delete --name spotlab-dev-rg" in note
    assert f"python -m lab export --checkpoint-uri {run.outputs['checkpointUri']}" in note
    gone = _run(package, retainCheckpoints="false")
    assert not [r.name for r in gone.resources if r.retain_on_delete]
    assert "keptOnDestroy" not in gone.outputs


def test_the_stack_files_override_the_training() -> None:
    dev = _container(run_program("dev"))["command"]
    a100 = _container(run_program("a100"))["command"]
    assert dev[-2:] == ["--lr=0.1", "--micro-batch-size=128"]
    assert a100[-2:] == ["--lr=0.2", "--micro-batch-size=128"]


def test_a_refusal_in_one_run_is_not_the_next_runs_error(package: Path) -> None:
    """The SDK keeps the Outputs that awaited a failed ``apply``; the harness forgets them."""
    started = _run(package)
    refused = _run(package, _recorded(started), trainArgs={**TRAIN_ARGS, "width": 64})
    assert isinstance(refused.error, ConfigRefused)
    assert _run(package).error is None
